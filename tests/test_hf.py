"""A Hugging Face Llama nobody here wrote (examples/hf_llama), through the generic path only:
``replay record`` -> ``info`` -> ``step`` -> ``bisect``, on one rank and on two ranks with torch's
tensor parallelism (DTensor) over gloo, with a bug planted on rank 1.

Recordings are made once per module (concurrently) and shared: the model is tiny and decodes six
steps, so the time goes to starting Python processes that import transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
PLANTED_AT = 3  # rank 1's model.norm weight is perturbed from this decode step on

RECIPE = [
    "--step", "examples.hf_llama.engine:HFDecoder.decode_step", "--state", "replay_state",
    "--config", "replay_config", "--factory", "examples.hf_llama.engine:build", "--modules", "model",
    "--keyframe-every", "3",
]


def _record(out: Path, *run_args: str, collectives: str = "auto") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", *RECIPE, "--collectives", collectives,
           "--", sys.executable, "-m", "examples.hf_llama.run", "--steps", str(STEPS), *run_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf")
    jobs = {
        "one": _record(base / "one"),
        "tp": _record(base / "tp", "--ranks", "2", "--tp", "--perturb-rank", "1", "--perturb-at", str(PLANTED_AT),
                      collectives="full"),
    }
    for name, p in jobs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (name, err.decode()[-3000:])
        assert b'"tokens"' in out, (name, out.decode()[-500:])
    return {k: base / k for k in jobs}


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


def _step(run_cli, rec: Path, *args: object) -> dict:
    res = run_cli("step", rec, *args, "--json", "--no-save")
    assert res.code == 0, res.err
    return res.json()


# -- one rank, eager -------------------------------------------------------------------------------


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_one_rank_records_every_step(recordings, run_cli):
    info = run_cli("info", recordings["one"], "--json").json()
    assert info["world_size"] == 1
    assert info["ranks"][0]["steps"] == STEPS and info["ranks"][0]["eager_steps"] == STEPS
    assert info["first_divergence"] is None


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_one_rank_step_reruns_bit_for_bit(recordings, run_cli):
    """Keyframe at step 3, step 4 fast-forwarded to: the static cache is the whole state, and the
    cache passed as an argument is the rebuilt engine's."""
    eager = _step(run_cli, recordings["one"], "--rank", 0, "--step", 4, "--mode", "eager")["modes"]["eager"]
    assert eager["departed"] is None and eager["error"] is None
    assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_one_rank_bisect_recorded_against_rerun(recordings, run_cli):
    res = run_cli("bisect", recordings["one"], "--rank", 0, "--step", 5, "--between", "recorded,rerun", "--json", "--no-save")
    assert res.code == 0, res.err
    data = res.json()
    assert data["first"] is None  # every tapped module of the HF model gives the same bits
    names = {m["module"] for m in data["modules"]}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.norm", "lm_head"} <= names
    assert all(s["reproduces_recording"] for s in data["sides"])


# -- two ranks, tensor-parallel over gloo, rank 1 perturbed ------------------------------------------


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_functional_collectives_are_recorded(recordings):
    """DTensor reduces through torch's functional collectives: two all-reduces per layer per step,
    the same output bits on both ranks, different inputs (each rank's partial sum)."""
    from replay.format.reader import Recording

    with Recording(recordings["tp"]) as rec:
        part = rec[next(iter(rec))]
        tables = {r: rf.full() for r, rf in part.items()}
    rows = {r: t.collectives[t.collectives["step"] == 2] for r, t in tables.items()}
    assert len(rows[0]) == len(rows[1]) == 2 * 2  # 2 layers x (attention, MLP)
    for r, t in tables.items():
        assert {t.string(int(x)) for x in rows[r]["op"]} == {"funcol.all_reduce"}
        assert set(rows[r]["group_size"]) == {2} and all(rows[r]["compare"])
        assert all(rows[r]["out_tensor"] >= 0)  # --collectives full
    assert list(rows[0]["out_digest"]) == list(rows[1]["out_digest"])
    assert all(a != b for a, b in zip(rows[0]["in_digest"], rows[1]["in_digest"]))


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_info_finds_the_planted_step(recordings, run_cli):
    info = run_cli("info", recordings["tp"], "--json").json()
    d = info["first_divergence"]
    assert (d["step"], d["field"], d["ranks"]) == (PLANTED_AT, "output.logits", [1])


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_one_rank_alone_replays_its_collectives(recordings, run_cli):
    """Rank 1 alone on a fake process group: its all-reduces answer from the recording, its own
    inputs to them match the recorded digests, and it reproduces its (perturbed) bits."""
    data = _step(run_cli, recordings["tp"], "--rank", 1, "--step", 4, "--mode", "eager")
    eager = data["modes"]["eager"]
    assert eager["departed"] is None and eager["error"] is None
    assert eager["collective_mismatches"] == []
    assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert eager["matches_ranks"]["logits"] == [1]
    before = _step(run_cli, recordings["tp"], "--rank", 0, "--step", 1, "--mode", "eager")["modes"]["eager"]
    assert before["matches_ranks"]["logits"] == [0, 1]  # before the planted step both ranks agree


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_all_ranks_with_live_collectives(recordings, run_cli):
    res = run_cli("step", recordings["tp"], "--ranks", "0-1", "--step", 4, "--mode", "eager", "--json", "--no-save")
    assert res.code == 0, res.err
    results = res.json()["results"]
    assert [r.get("error") for r in results] == [None, None]
    for r in results:
        assert r["collectives"] == "live"
        assert r["modes"]["eager"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_bisect_names_the_planted_module(recordings, run_cli):
    """At the first step where the ranks disagree, the first module that differs (shards aside) is
    the one whose weight was perturbed; the shards of the sharded projections are rank-local."""
    res = run_cli("bisect", recordings["tp"], "--between", "rank:0,rank:1", "--json", "--no-save")
    assert res.code == 0, res.err
    data = res.json()
    assert data["step"] == PLANTED_AT
    assert data["first_module"] == "model.norm"
    local = {m["module"] for m in data["modules"] if m["rank_local"]}
    assert "model.layers.0.self_attn.q_proj" in local and "model.layers.0.mlp.down_proj" in local
    before = [m for m in data["modules"][: [m["module"] for m in data["modules"]].index("model.norm")] if not m["rank_local"]]
    assert before and all(m["verdict"] == "bitwise equal" for m in before)


# -- the pieces of the generic path this example needed ---------------------------------------------


def test_object_argument_is_recorded_as_the_engines_attribute():
    import inspect

    from replay.record.calls import split_arguments

    class Engine:
        def __init__(self) -> None:
            self.cache = object()

        def step(self, x, pos, cache, other=None):  # noqa: ANN001
            return x

    e = Engine()
    import torch

    bound = inspect.signature(Engine.step).bind(e, torch.zeros(2), 3, e.cache, other=object())
    tensors, scalars = split_arguments(bound, skip_first=True, owner=e)
    assert list(tensors) == ["x"]
    assert scalars["pos"] == 3
    assert scalars["cache"] == {"attr": "cache", "type": "object"}
    assert set(scalars["other"]) == {"unrecorded", "object"}
    assert scalars["other"]["unrecorded"] == "object"
    # The same object keeps its number across steps; a new one (a second cache) gets another.
    other = bound.arguments["other"]
    again = split_arguments(inspect.signature(Engine.step).bind(e, torch.zeros(2), 4, e.cache, other=other),
                            skip_first=True, owner=e)[1]
    fresh = split_arguments(inspect.signature(Engine.step).bind(e, torch.zeros(2), 5, e.cache, other=object()),
                            skip_first=True, owner=e)[1]
    assert again["other"] == scalars["other"]
    assert fresh["other"]["object"] != scalars["other"]["object"]


def test_run_cli_rejects_bad_arguments():
    from examples.hf_llama.run import main

    assert main(["--preset", "nope"]) == 2
    assert main(["--graphs", "manual", "--device", "cpu"]) == 2


@pytest.mark.parametrize("collectives", [0, 1], ids=["replicated", "reduced"])
def test_rank_local_needs_a_reduction(collectives):
    """Rank against rank, a module whose weights differ is a shard only if the step reduces
    something; in a replicated run with one rank perturbed it is the difference itself."""
    import torch

    from replay.bisect.layers import Side, SideRun, compare_captures
    from replay.bisect.taps import Frame, TapCapture, TapEvent

    def side(rank: int, value: float) -> SideRun:
        frames = {0: Frame(0, "", None, 0, collectives), 1: Frame(1, "lin", 0, 0, 0)}
        ev = TapEvent(module="lin", index=0, n_out=1, output=torch.full((2,), value), inputs=[torch.ones(2)],
                      source="eager", frame=1, frames=frames)
        cap = TapCapture(events=[ev], tapped=["lin"], called={"lin"})
        return SideRun(side=Side(f"rank {rank}", rank, "eager"), capture=cap, outputs={}, reproduces=True, departed=None,
                       keyframe=0, ran_as="eager", params={"lin.weight": rank + 1}, seconds=0.0)

    (row,) = compare_captures(side(0, 1.0), side(1, 2.0))
    assert row.differs and row.inputs_equal
    assert row.rank_local is bool(collectives)
