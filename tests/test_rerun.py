"""`replay step` on recordings of a toy multi-rank engine made by `replay record`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def record(out: Path, world: int, steps: int, config: dict, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet",
        "--step", "tests.toy_engine:ToyEngine.step", "--state", "state_tensors", "--config", "replay_config",
        "--factory", "tests.toy_engine:build", "--keyframe-every", "4", *extra,
        "--", sys.executable, "-m", "tests.toy_engine", str(world), str(steps), json.dumps(config),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    base = tmp_path_factory.mktemp("rerun")
    jobs = {
        "drift": record(base / "drift", 3, 12, {"seed": 0, "perturb_rank": 1, "perturb_at": 6}, "--collectives", "full"),
        "digest_only": record(base / "digest_only", 2, 5, {"seed": 1}, "--collectives", "digest"),
        "rng": record(base / "rng", 1, 9, {"seed": 2, "use_rng": True}),
    }
    for name, p in jobs.items():
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, (name, err.decode()[-2000:])
    return {k: base / k for k in jobs}


def test_every_step_reruns_bit_for_bit(recordings, run_cli):
    """With no nondeterminism, any step of any rank re-runs to the recorded bits."""
    for rank, step in [(0, 0), (0, 5), (2, 11), (1, 3)]:
        res = run_cli("step", recordings["drift"], "--rank", rank, "--step", step, "--mode", "eager", "--json", "--no-save")
        assert res.code == 0, res.err
        data = res.json()
        eager = data["modes"]["eager"]
        assert eager["departed"] is None
        assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"
        assert eager["vs_recording"]["tokens"]["verdict"] == "bitwise equal"
        assert rank in eager["matches_ranks"]["logits"]


def test_odd_rank_reproduces_its_own_bits(recordings, run_cli):
    info = run_cli("info", recordings["drift"], "--json").json()
    d = info["first_divergence"]
    assert (d["step"], d["ranks"], d["field"]) == (6, [1], "output.logits")
    res = run_cli("step", recordings["drift"], "--rank", 1, "--step", 6, "--mode", "eager", "--json", "--no-save")
    data = res.json()
    eager = data["modes"]["eager"]
    assert eager["matches_ranks"]["logits"] == [1]  # the re-run reproduces the odd rank, not the others
    vs_others = [v for v in data["verdicts"] if v["b"] in ("rank 0 recorded logits", "rank 2 recorded logits")]
    assert vs_others and all(v["verdict"] != "bitwise equal" and v["max_abs"] > 0 for v in vs_others)


def test_one_rank_alone_needs_full_collectives(recordings, run_cli):
    res = run_cli("step", recordings["digest_only"], "--rank", 1, "--step", 2, "--mode", "eager")
    assert res.code == 7
    assert res.err.count("\n") == 1 and "--collectives full" in res.err


def test_rng_state_is_restored(recordings, run_cli):
    res = run_cli("step", recordings["rng"], "--rank", 0, "--step", 6, "--mode", "eager", "--json", "--no-save", "--repeat", "3")
    eager = res.json()["modes"]["eager"]
    assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert eager["repeats_equal"] is True


def test_step_and_rank_out_of_range(recordings, run_cli):
    res = run_cli("step", recordings["drift"], "--rank", 9, "--step", 1)
    assert res.code == 2 and "no rank 9" in res.err and "0..2" in res.err
    res = run_cli("step", recordings["drift"], "--rank", 0, "--step", 99)
    assert res.code == 2 and "no step 99" in res.err and "0..11" in res.err
    res = run_cli("step", recordings["drift"], "--rank", 0, "--step", 1, "--mode", "sideways")
    assert res.code == 2 and "sideways" in res.err


def test_wrong_factory_is_one_line(recordings, run_cli):
    for fac, words in [("nosuch.module:build", "cannot import"), ("tests.toy_engine:nothing", "has no"),
                       ("tests.toy_engine:ToyEngine", "does not take")]:
        res = run_cli("step", recordings["drift"], "--rank", 0, "--step", 1, "--factory", fac)
        assert res.code == 6 and res.err.count("\n") <= 2 and words in res.err, res.err


def test_several_ranks_with_live_collectives(recordings, run_cli):
    res = run_cli("step", recordings["drift"], "--ranks", "0-2", "--step", 7, "--mode", "eager", "--json")
    assert res.code == 0, res.err
    results = res.json()["results"]
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r.get("collectives") == "live", r
        assert r["modes"]["eager"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"


# -- the target's Python scalar state, and the typed step result (issue 14/18) ------------------


def test_keyframes_keep_only_scalars_that_changed_and_a_rerun_sets_them_back() -> None:
    from replay.core.state import (SCALAR_PREFIX, STR_PREFIX, STR_UNCHANGED_PREFIX, UNCHANGED_PREFIX, restore_scalars,
                                   split_scalars, with_scalars)

    class Eng:
        def __init__(self) -> None:
            self.step_index, self.scale, self.double, self.name = 0, 0.5, True, "x"

    eng = Eng()
    fn = with_scalars(lambda: {"h": torch.zeros(2)}, lambda: eng)
    assert fn is not None
    # The first keyframe: nothing has changed yet; the values are kept apart (maybe configuration).
    assert set(fn()) == {"h", *(UNCHANGED_PREFIX + n for n in ("step_index", "scale", "double")), STR_UNCHANGED_PREFIX + "name"}
    eng.step_index, eng.name = 20, "adapter-b"  # a str the loop sets between steps (the active adapter)
    kf = fn()
    assert set(kf) == {"h", SCALAR_PREFIX + "step_index", UNCHANGED_PREFIX + "scale", UNCHANGED_PREFIX + "double", STR_PREFIX + "name"}
    unchanged: dict = {}
    tensors, scalars = split_scalars(kf, unchanged)
    assert set(tensors) == {"h"} and scalars == {"step_index": 20, "name": "adapter-b"}  # configuration (scale, double) is not restored
    assert unchanged == {"scale": 0.5, "double": True}  # ... but on the program's own object (a re-launch)
    fresh = Eng()
    assert restore_scalars(fresh, {**scalars, "missing": 1, "scale": 3}) == ["missing", "scale"]  # int over a float: refused
    assert fresh.step_index == 20 and fresh.scale == 0.5 and fresh.name == "adapter-b"


def test_keyframes_keep_the_state_of_generators_the_target_holds() -> None:
    """The target's own generators (its submodules', a sampler object's) are in the keyframe and
    set back by path; the default generator is the step's RNG state, not these."""
    from replay.core.state import capture_generators, restore_generators, split_generators

    class Sampling:
        def __init__(self) -> None:
            self.gen = torch.Generator().manual_seed(7)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.lin.noise = torch.Generator().manual_seed(3)
            self.sampling = Sampling()

    m = Model()
    kf = {"h": torch.zeros(1), **capture_generators(m)}
    tensors, gens = split_generators(kf)
    assert set(tensors) == {"h"} and set(gens) == {"lin.noise", "sampling.gen"}
    want = torch.rand(3, generator=m.sampling.gen), torch.rand(3, generator=m.lin.noise)
    assert restore_generators(m, {**gens, "missing.gen": gens["lin.noise"]}) == ["missing.gen"]
    assert torch.equal(torch.rand(3, generator=m.sampling.gen), want[0])
    assert torch.equal(torch.rand(3, generator=m.lin.noise), want[1])


def test_a_step_result_reads_back_as_the_same_typed_result() -> None:
    from replay.analysis.compare import Comparison, Verdict
    from replay.errors import RecordingDamaged
    from replay.rerun.result import ModeRun, StepDeparture, StepRerun, WeightCheck
    from replay.states import RESULTS_FORMAT_VERSION

    run = ModeRun(mode="eager", outputs={}, digests={"logits": 5}, departed=StepDeparture(3, "output.logits"),
                  caught_up=[2, 3], vs_recording={"logits": Comparison("a", "b", Verdict.DIFFERENT, mismatched=2, numel=8)})
    r = StepRerun(recording="R", part="run-000", rank=1, step=4, keyframe=2, device="cpu", factory=None, modes={"eager": run},
                  notes=["n"], weights=WeightCheck(checked=3, differ=["w"]))
    d = r.to_json()
    assert d["format"] == RESULTS_FORMAT_VERSION and d["kind"] == "step"
    back = StepRerun.from_json(d)
    assert back.to_json() == d
    assert back.problem() is None and not back.modes["eager"].vs_recording["logits"].equal
    with pytest.raises(RecordingDamaged):
        StepRerun.from_json({**d, "format": RESULTS_FORMAT_VERSION + 1})


def test_a_step_that_torch_compile_did_not_compile_is_never_reported_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 failure mode: the re-run said "torch.compile(...)" while the Python function ran.
    With Dynamo off, the compiled re-run raises instead of comparing eager bits under that name."""
    import torch._dynamo

    from replay.errors import RerunError
    from replay.rerun.target import StepKind, TargetSpec, function_step

    def step_fn(x: torch.Tensor) -> torch.Tensor:
        return x * 3 + 1

    spec = TargetSpec(step="m:step_fn", factory=None, config=None, state=None, modules=None, device="cpu",
                      compile={"backend": "eager", "fullgraph": True})
    fn, ran_as = function_step(step_fn, StepKind.COMPILED, spec, "recorded")
    assert ran_as.startswith("torch.compile(") and torch.equal(fn(torch.ones(2)), torch.full((2,), 4.0))  # control
    torch._dynamo.reset()

    def also(x: torch.Tensor) -> torch.Tensor:
        return x - 1

    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    spec.compile = {"backend": "eager"}  # (with fullgraph=True torch itself refuses to run it)
    fn, _ = function_step(also, StepKind.COMPILED, spec, "recorded")
    with pytest.raises(RerunError, match="without compiling it"):
        fn(torch.ones(2))


def test_recorded_collectives_are_torchs_own_again_after_the_rerun(tmp_path):
    """A module imported during a one-rank re-run binds the stand-ins (``from c10d import
    scatter``); once the re-run is over, calling them must reach torch.distributed itself, not
    the recording (a DTensor built later in the same process crashed on 'no more collectives')."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from replay.errors import RerunError
    from replay.format.reader import Recording
    from replay.rerun.collectives import RecordedCollectives
    from tests.factories import make_recording

    path = make_recording(tmp_path, ranks=2, steps=2)
    with Recording(path) as rec:
        rc = RecordedCollectives(rec["run-000"][0], rank=0, world_size=2)
        with rc.installed():
            kept = c10d.broadcast  # what a module imported now would hold
            with pytest.raises(RerunError):
                kept(torch.zeros(2), src=0)  # inside: answered from the recording (which has none)
        assert not dist.is_initialized()
        with pytest.raises(Exception) as e:
            kept(torch.zeros(2), src=0)  # after: torch's own, which has no process group here
        assert not isinstance(e.value, RerunError), e.value


def _mode_run(mode, verdicts, error=None, recorded_error=None):
    from replay.analysis.compare import Comparison, Verdict
    from replay.rerun.result import ModeRun

    vs = {name: Comparison("rerun", "recorded", Verdict.BITWISE_EQUAL if same else Verdict.DIFFERENT) for name, same in verdicts.items()}
    return ModeRun(mode=mode, outputs={}, digests={k: 1 for k in verdicts}, vs_recording=vs, error=error, recorded_error=recorded_error)


@pytest.mark.parametrize("modes, expected", [
    ({"eager": {"logits": True}}, "reproduced: rank 1 step 7 re-ran bit for bit in eager"),
    ({"eager": {"logits": True}, "cudagraph": {"logits": False}},
     "not reproduced: rank 1 step 7 in cudagraph: logits is different from the recording; eager reproduces it bit for bit"),
    ({"eager": {}}, "not compared: rank 1 step 7: eager: no output of step 7 could be compared"),
], ids=["reproduced", "one-mode-differs", "nothing-compared"])
def test_the_step_headline_claims_only_what_was_compared(modes, expected):
    from replay.rerun.result import StepRerun

    r = StepRerun(recording="r", part="run-000", rank=1, step=7, keyframe=0, device="cpu", factory=None,
                  modes={m: _mode_run(m, v) for m, v in modes.items()})
    assert r.headline().startswith(expected), r.headline()


@pytest.mark.parametrize("recorded, expected", [
    ("compiled", "reproduced: rank 1 step 7 re-ran bit for bit in compiled, the mode it ran in when recorded (1 output(s) "
                 "bitwise equal to the recording); it differs from the recording in the mode it did not run in: in eager "
                 "logits is different"),
    ("eager", "not reproduced: rank 1 step 7 in eager: logits is different from the recording; compiled reproduces it"),
], ids=["recorded-mode-reproduces", "recorded-mode-differs"])
def test_the_step_headline_leads_with_the_mode_the_step_was_recorded_in(recorded, expected):
    """A compiled step whose eager re-run differs (inductor's kernels round otherwise) reproduced
    in the mode it ran in: "reproduced", the other mode named as differing (before: "not
    reproduced ... in eager"); a difference in the recorded mode stays "not reproduced"."""
    from replay.rerun.result import StepRerun

    r = StepRerun(recording="r", part="run-000", rank=1, step=7, keyframe=0, device="cpu", factory=None,
                  modes={"compiled": _mode_run("compiled", {"logits": True}), "eager": _mode_run("eager", {"logits": False})},
                  recorded_mode=recorded)
    if recorded == "eager":
        r.modes = {"eager": _mode_run("eager", {"logits": False}), "compiled": _mode_run("compiled", {"logits": True})}
    assert r.headline().startswith(expected), r.headline()
    assert StepRerun.from_json(r.to_json()).recorded_mode == recorded


def test_the_step_headline_of_a_step_that_raised_is_not_compared():
    from replay.rerun.result import StepRerun

    raised = _mode_run("eager", {"logits": True}, error="RuntimeError: boom")
    r = StepRerun(recording="r", part="run-000", rank=0, step=3, keyframe=0, device="cpu", factory=None, modes={"eager": raised})
    assert r.headline().startswith("not compared: rank 0 step 3: eager: step 3 raised RuntimeError: boom in the re-run")
    same = _mode_run("eager", {"logits": True}, error="RankDriftError: x", recorded_error="RankDriftError: x")
    r.modes = {"eager": same}
    assert r.headline().endswith("it raised RankDriftError as it did when recorded")
    # What it computed before raising compared equal, and it raised as recorded: said, never exit 0.
    assert r.problem() is None and r.exit_reason() == "rank 0 step 3 raised RankDriftError in the re-run, as it did when recorded"
    # Raising as recorded with nothing compared is no comparison at all.
    r.modes = {"eager": _mode_run("eager", {}, error="ValueError: y", recorded_error="ValueError: y")}
    assert r.headline().startswith("not compared: rank 0 step 3: eager: step 3 raised ValueError in the re-run, as it did when recorded")
    assert "bit for bit" not in r.headline() and r.exit_reason() == r.problem()


def test_only_data_objects_are_recorded_field_by_field() -> None:
    """``step(batch)``: a dataclass, a NamedTuple or a class of data is flattened to inputs and
    rebuilt; an object with behaviour (a cache with ``update``) or one holding more than
    MAX_OBJECT_BYTES of tensors is not (it would be copied every step, and could not be given
    its behaviour back)."""
    import dataclasses
    from typing import NamedTuple

    from replay.core.structure import MAX_OBJECT_BYTES, RecordedObject, flatten_object, rebuild_inputs

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        scale: float
        cache: list

    class Pair(NamedTuple):
        a: torch.Tensor
        b: int

    class Cache:
        def __init__(self) -> None:
            self.k = [torch.zeros(2)]

        def update(self, x: torch.Tensor) -> None:
            self.k.append(x)

    b = Batch(torch.arange(3), 0.5, [torch.ones(2), None])
    tensors, spec = flatten_object("batch", b)
    assert set(tensors) == {"batch.ids", "batch.cache.0"}
    back = rebuild_inputs(dict(tensors), {"batch": spec})["batch"]
    assert isinstance(back, RecordedObject) and back.scale == 0.5 and back.cache[1] is None
    assert torch.equal(back.ids, b.ids)
    real = back.as_instance(Batch(torch.zeros(1), 9.0, []))
    assert type(real) is Batch and real.scale == 0.5 and torch.equal(real.ids, b.ids)
    t2, s2 = flatten_object("p", Pair(torch.ones(1), 3))
    pair = rebuild_inputs(dict(t2), {"p": s2})["p"].as_instance(Pair(torch.zeros(1), 0))
    assert type(pair) is Pair and pair.b == 3 and torch.equal(pair.a, torch.ones(1))
    assert flatten_object("c", Cache()) is None
    big = Batch(torch.zeros(MAX_OBJECT_BYTES // 4 + 1, dtype=torch.float32), 1.0, [])
    assert flatten_object("big", big) is None
    # A serving batch: Python lists beside the tensors (request ids, temperatures) are kept as
    # values (before: one such field made the whole batch "recorded by class name only").
    served = Batch(torch.arange(2), 1.0, [["req-a", "req-b"], {"temps": [0.7, 1.0]}, []])
    t3, s3 = flatten_object("batch", served)
    assert set(t3) == {"batch.ids"}
    again = rebuild_inputs(dict(t3), {"batch": s3})["batch"]
    assert again.cache == [["req-a", "req-b"], {"temps": [0.7, 1.0]}, []]
    # A prompt's token ids as a Python list would go into every step's record: not kept.
    assert flatten_object("batch", Batch(torch.arange(2), 1.0, list(range(1000)))) is None


def test_repeats_that_vary_lead_the_not_reproduced_verdict_not_the_keyframe_advice():
    """Trial 21: `--repeat 3` of a step with an unseeded random term: the table said "bits vary",
    and the headline advised `--keyframe-every 1` (the catch-up from the keyframe re-ran bit for
    bit), which no keyframe can help."""
    from replay.rerun.result import StepRerun

    varied = _mode_run("eager", {"logits": False})
    varied.repeats_equal = False
    varied.caught_up = [4, 5, 6]
    r = StepRerun(recording="r", part="run-000", rank=0, step=7, keyframe=4, device="cpu", factory=None, modes={"eager": varied})
    text = r.headline()
    assert text.startswith("not reproduced: rank 0 step 7 in eager"), text
    assert "repeated runs of the step gave different bits (eager)" in text, text
    assert "--keyframe-every" not in text, text
    varied.repeats_equal = None  # run once: the catch-up evidence points between the steps
    assert "--keyframe-every 1" in r.headline()
