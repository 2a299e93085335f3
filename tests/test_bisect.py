"""`replay bisect` on CPU: steps, layers and settings, for every drift cause the engines switch on.

Each cause is recorded once (module-scoped; the recordings run concurrently) by `replay record`
in a subprocess, as a user would, and bisected through the CLI in-process:

| recording | cause | step | module | toggle |
| --- | --- | --- | --- | --- |
| toy | rank 1 perturbed from step 6 | 6 (ranks), 5 (re-run, perturbed) | - | - |
| tactic | MoE combine tactic forced on rank 1 | 0 | layers.0.moe.combine | force_tactic |
| stale | padded rows keep stale slot ids and pages (graph runner) | first eager departure | the mixer of the layer written through | bug_stale_padding |
| baked | KV page count baked in at capture | first step past one page | layers.0.attn | bug_baked_kv_len |
| tp | one-shot all-reduce, 4 ranks, tensor parallel | 0 | layers.0.attn | one_shot_allreduce (slow) |
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.bisect.config import ConfigBisectSettings, bisect_config
from replay.bisect.ddmin import ddmin, split
from replay.bisect.layers import Side, SideRun, compare_captures
from replay.bisect.taps import Taps
from replay.format.reader import Recording

ROOT = Path(__file__).resolve().parents[1]
MTP = [sys.executable, "-m", "replay.workloads.mtp"]
TOY = ["--step", "tests.toy_engine:ToyEngine.step", "--state", "state_tensors", "--config", "replay_config",
       "--factory", "tests.toy_engine:build"]
PAGE, K = 16, 3  # the tiny preset's KV page size, and the engine's default draft length

ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # as torchrun would: the engine runs in-process

SCENARIOS: dict[str, tuple[list[str], list[str], dict[str, str]]] = {
    "toy": ([sys.executable, "-m", "tests.toy_engine", "3", "12", json.dumps({"seed": 0, "perturb_rank": 1, "perturb_at": 6})],
            [*TOY, "--keyframe-every", "4", "--collectives", "full"], {}),
    "tactic": ([*MTP, "--ranks", "2", "--steps", "3", "--force-tactic", "1:moe_combine:bf16"],
               ["--keyframe-every", "2", "--collectives", "full"], {}),
    "stale": ([*MTP, "--steps", "3", "--batch", "3", "--cudagraph", "--bug-stale-padding"], ["--keyframe-every", "2"], ONE_RANK),
    "baked": ([*MTP, "--steps", "8", "--batch", "1", "--seed", "11", "--cudagraph", "--bug-baked-kv-len"],
              ["--keyframe-every", "2"], ONE_RANK),
    "tp": ([*MTP, "--ranks", "4", "--layout", "tp", "--steps", "2", "--one-shot-allreduce", "--no-lockstep"],
           ["--keyframe-every", "2", "--collectives", "full"], {}),
}


@pytest.fixture(scope="module")
def recs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("bisect")
    jobs = {}
    for name, (cmd, extra, env) in SCENARIOS.items():
        args = [sys.executable, "-m", "replay", "record", "--out", str(base / name), "--quiet", *extra, "--", *cmd]
        jobs[name] = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, p in jobs.items():
        _, err = p.communicate(timeout=280)
        # 3: the engine's lockstep check stopped a drifting run; what it recorded is complete.
        assert p.returncode in (0, 3), (name, err.decode()[-2000:])
    return {name: base / name for name in jobs}


def bisect(run_cli: Any, rec: Path, *args: Any) -> dict[str, Any]:
    res = run_cli("bisect", rec, *args, "--json")
    assert res.code == 0, res.err
    return res.json()


def departure_step(rec: Path) -> int:
    """The first step whose attention needs a second KV page: where a graph that baked in one
    page at capture starts to read too little."""
    with Recording(rec) as r:
        rf = r["run-000"][0]
        return next(s for s in range(rf.n_steps) if int(rf.step(s).inputs["input_pos"].max()) + K + 1 > PAGE)


# -- delta debugging and taps, without a recording ------------------------------------------


@pytest.mark.parametrize(
    "needed", [{5}, {0, 7}, {2, 3, 4}, set(range(8))], ids=["one", "two-apart", "three-adjacent", "all"]
)
def test_ddmin_is_one_minimal_and_asks_each_subset_once(needed: set[int]) -> None:
    asked: list[tuple[int, ...]] = []

    def flips(subset: list[int]) -> bool:
        asked.append(tuple(sorted(subset)))
        return needed <= set(subset)

    assert sorted(ddmin(list(range(8)), flips)) == sorted(needed)
    assert len(asked) == len(set(asked))
    assert split(list(range(5)), 2) == [[0, 1], [2, 3, 4]] and split([1], 3) == [[1]]


class _Stub:
    """What Taps.install needs of a Target."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def module(self) -> torch.nn.Module:
        return self.model


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.branch = torch.nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = self.b(self.a(x) * 2)  # "* 2": code of the root between two modules
        return self.branch(h) if take_branch else h


def _side(label: str, model: _Net, x: torch.Tensor, take_branch: bool) -> SideRun:
    taps = Taps()
    taps.install(_Stub(model))  # type: ignore[arg-type]
    model(x, take_branch)  # not armed (a warm-up): not recorded
    taps.arm()
    model(x, take_branch)
    cap = taps.disarm()
    taps.close()
    return SideRun(side=Side(label, 0, "eager"), capture=cap, outputs={}, reproduces=True, departed=None, keyframe=0,
                   ran_as="eager", params={}, seconds=0.0)


def test_taps_pair_outputs_and_name_what_never_fired() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    net = _Net()
    a = _side("a", net, x, take_branch=True)
    assert [e.module for e in a.capture.events] == ["a", "b", "branch"]
    assert "forward" not in net.__dict__  # close() took the wrappers out
    rows = compare_captures(a, _side("b", net, x, take_branch=False))
    verdicts = {m.name: m.verdict for m in rows}
    assert verdicts == {"a": "bitwise equal", "b": "bitwise equal", "branch": "missing"}
    assert "never fired" in next(m.note for m in rows if m.name == "branch")
    # A module that computes differently from equal inputs is told apart from one whose inputs differ.
    other = _Net()
    with torch.no_grad():
        other.b.weight[0, 0] += 1.0
    rows = compare_captures(a, _side("c", other, x, take_branch=True))
    assert [(m.name, m.differs, m.inputs_equal) for m in rows] == [("a", False, True), ("b", True, True), ("branch", True, False)]


# -- steps ------------------------------------------------------------------------------------


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_steps_between_ranks_from_digests(recs: dict[str, Path], run_cli: Any) -> None:
    d = bisect(run_cli, recs["toy"], "--steps")
    assert (d["kind"], d["how"], d["first"], d["odd"], d["majority"]) == ("bisect-steps", "ranks", 6, [1], [0, 2])
    assert Path(d["saved_to"]).parent == recs["toy"] / "results"
    assert bisect(run_cli, recs["toy"], "--steps", "--ranks", "0,2")["first"] is None
    assert bisect(run_cli, recs["toy"], "--steps", "--ranks", "0-1", "--no-save")["first"] == 6
    d = bisect(run_cli, recs["tactic"], "--steps", "--no-save")
    assert (d["first"], d["odd"], d["field"]) == (0, [1], "output.logits")


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_steps_against_rerun_bisects_keyframe_intervals(recs: dict[str, Path], run_cli: Any) -> None:
    """A re-run made to depart from step 5 (keyframes every 4: intervals 0-3, 4-7, 8-11): the
    search re-runs the last interval, then the middle one, then the first, and names step 5."""
    args = ["--steps", "--against-rerun", "--rank", "0", "--no-save"]
    d = bisect(run_cli, recs["toy"], *args, "--set", "perturb_rank=0", "--set", "perturb_at=5")
    assert (d["how"], d["first"]) == ("rerun", 5)
    assert [(p["from"], p["departed"]) for p in d["probes"]] == [(8, 8), (4, 5), (0, None)]
    assert d["steps_rerun"] < 12
    assert bisect(run_cli, recs["toy"], *args)["first"] is None


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_steps_against_rerun_finds_the_baked_value(recs: dict[str, Path], run_cli: Any) -> None:
    """Recorded under a graph that baked in one KV page: an eager re-run departs at the first
    step that needs two; a graph re-run reproduces every step."""
    d = bisect(run_cli, recs["baked"], "--steps", "--against-rerun", "--mode", "eager", "--no-save")
    assert d["first"] == departure_step(recs["baked"]) > 0 and d["field"] == "output.logits"
    d = bisect(run_cli, recs["baked"], "--steps", "--against-rerun", "--mode", "cudagraph", "--exhaustive", "--no-save")
    assert d["first"] is None and len(d["probes"]) == 4


# -- layers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("between", ["eager,cudagraph", "recorded,rerun"])
@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_layers_name_the_attention_that_reads_the_baked_page_count(recs: dict[str, Path], run_cli: Any, between: str) -> None:
    step = departure_step(recs["baked"])
    d = bisect(run_cli, recs["baked"], "--rank", 0, "--step", step, "--between", between)
    assert d["kind"] == "bisect-layers" and d["step"] == step and len(d["between"]) == 2
    # wo is the first output that differs (its input already does); attention itself is where the
    # difference is made: its inputs are bitwise equal on both sides.
    assert d["first"] == "layers.0.attn.wo" and d["maker"] == "layers.0.attn"
    assert d["before"][-1] == "layers.0.attn.wv" and "layers.0.attn" in d["origin"]
    mods = {m["name"]: m for m in d["modules"]}
    assert mods["layers.0.attn"]["verdict"] == "different" and mods["layers.0.attn"]["max_abs"] > 0
    assert mods["layers.0.attn.wq"]["verdict"] == "bitwise equal" and not d["silent"]
    graph_side = d["sides"][1] if between == "eager,cudagraph" else d["sides"][0]
    assert graph_side["reproduces_recording"] and graph_side["ran_as"].startswith("graph")
    assert json.loads(Path(d["saved_to"]).read_text())["first"] == d["first"]


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_layers_name_the_layer_the_stale_padding_corrupts(recs: dict[str, Path], run_cli: Any) -> None:
    """Padded rows keep a real request's slot and pages: the graph's mixer writes the padded row's
    KV (attention) or state (recurrence) into that request, which then reads it back."""
    step = bisect(run_cli, recs["stale"], "--steps", "--against-rerun", "--no-save")["first"]
    assert step is not None
    d = bisect(run_cli, recs["stale"], "--rank", 0, "--step", step, "--between", "eager,cudagraph", "--no-save")
    assert re.fullmatch(r"layers\.\d+\.(attn|recurrent)", d["maker"])
    # The mixer turns bitwise equal inputs into outputs beyond tolerance. Modules before it may
    # differ by rounding only: a GEMM over the graph's padded batch can round differently from the
    # eager one on some CPUs (seen on AMD EPYC with MKL); that must not hide the mixer.
    mixer = next(m for m in d["modules"] if m["name"] == d["maker"])
    assert mixer["inputs_equal"] and mixer["verdict"] == "different" and mixer["max_abs"] > 1e-3
    # The graph ran a padded batch (4 rows for 3 requests): outputs are compared on the real rows.
    assert any("padding" in m["note"] for m in d["modules"])


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_layers_rank_against_rank_name_the_moe_combine(recs: dict[str, Path], run_cli: Any) -> None:
    d = bisect(run_cli, recs["tactic"], "--between", "rank:0,rank:1", "--no-save")
    assert d["step"] == 0 and d["ranks"] == [0, 1]
    # Rank 1's prefill already ran the bf16 combine, so its MTP state differs before step 0; the
    # first module to turn equal inputs into different outputs is the combine.
    assert d["maker"] == "layers.0.moe.combine"
    assert "state carried over" in d["origin"]
    only = bisect(run_cli, recs["tactic"], "--between", "rank:0,rank:1", "--step", 0, "--modules", "layers.*.moe.*", "--no-save")
    assert {m["module"] for m in only["modules"]} <= {f"layers.{i}.moe.{s}" for i in range(3) for s in ("router", "combine")}
    assert only["first"] == "layers.0.moe.combine"


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_layers_tensor_parallel_one_shot_all_reduce(recs: dict[str, Path], run_cli: Any) -> None:
    d = bisect(run_cli, recs["tp"], "--between", "rank:0,rank:1", "--step", 0, "--no-save")
    local = [m["name"] for m in d["modules"] if m["rank_local"]]
    # Shards differ by design until their all-reduce: the q/k/v/o projections, the combine of
    # sharded experts. They are shown but never named; the attention's reduced output is.
    assert "layers.0.attn.wq" in local and "layers.0.moe.combine" in local
    assert d["maker"] == "layers.0.attn" and d["maker"] not in local


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_layers_errors_are_one_line(recs: dict[str, Path], run_cli: Any) -> None:
    for args, words in [
        (["--rank", 0, "--between", "eager,cudagraph"], "give --step"),
        (["--rank", 0, "--step", 3, "--between", "eager"], "name two executions"),
        (["--rank", 0, "--step", 3, "--between", "eager,sideways"], "unknown execution"),
        (["--rank", 0, "--step", 3, "--between", "rank:1,rank:1"], "the same"),
        (["--rank", 0, "--step", 3, "--between", "rank:0,rank:1", "--mode", "eager"], "no torch.nn.Module"),
        (["--steps", "--config"], "cannot be combined"),
        ([], "say what to bisect"),
    ]:
        res = run_cli("bisect", recs["toy"], *args)
        errors = [line for line in res.err.splitlines() if line.startswith("replay: error:")]
        assert res.code == 2 and len(errors) == 1 and words in errors[0] and "Traceback" not in res.err, (args, res.err)


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_config_names_the_forced_tactic_and_resumes(recs: dict[str, Path], run_cli: Any) -> None:
    rec = recs["tactic"]
    settings = ConfigBisectSettings(rank=1, step=0, toggles=["force_tactic", "deterministic"], max_probes=2)
    first = bisect_config(rec, "run-000", settings)
    assert first.status == "incomplete" and first.probes_run == 2 and first.criterion == "ranks" and first.reference == 0
    assert Path(first.state_path).exists()
    # Interrupted: the same command resumes, answering the first two probes from the saved state.
    d = bisect(run_cli, rec, "--config", "--rank", 1, "--step", 0, "--toggles", "force_tactic,deterministic")
    assert d["kind"] == "bisect-config" and d["status"] == "done"
    assert d["minimal"] == ["force_tactic=[]"]
    assert [t["cached"] for t in d["tried"]] == [True, True, False] and d["probes_run"] == 1
    assert [t["outcome"] for t in d["tried"]] == ["differs", "matches", "matches"]


@pytest.mark.parametrize(
    "name, toggles, expect",
    [("stale", "bug_stale_padding,deterministic", "bug_stale_padding=false"),
     ("baked", "bug_baked_kv_len", "bug_baked_kv_len=false")],
    ids=["stale-padding", "baked-value"],
)
@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_config_names_the_graph_hazard(recs: dict[str, Path], run_cli: Any, name: str, toggles: str, expect: str) -> None:
    rec = recs[name]
    step = departure_step(rec) if name == "baked" else 1
    d = bisect(run_cli, rec, "--config", "--rank", 0, "--step", step, "--toggles", toggles, "--no-save")
    assert d["criterion"] == "eager" and d["status"] == "done" and d["minimal"] == [expect]
    assert d["tried"][0]["outcome"] == "differs"  # the recorded settings: graph and eager disagree


@pytest.mark.slow
@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_config_live_names_the_one_shot_all_reduce(recs: dict[str, Path], run_cli: Any) -> None:
    """All four ranks re-run together with live (gloo) collectives for each probe."""
    d = bisect(run_cli, recs["tp"], "--config", "--rank", 1, "--step", 0, "--criterion", "live",
               "--toggles", "one_shot_allreduce", "--no-save")
    assert d["status"] == "done" and d["minimal"] == ["one_shot_allreduce=false"]


# -- the sub-commands, and what the old one-command form maps onto -----------------------------


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_subcommands_answer_as_the_old_flags_do(recs: dict[str, Path], run_cli: Any) -> None:
    new = run_cli("bisect", "steps", recs["toy"], "--no-save", "--json")
    old = run_cli("bisect", recs["toy"], "--steps", "--no-save", "--json")
    assert new.code == old.code == 0
    drop = ("format_version",)
    assert {k: v for k, v in new.json().items() if k not in drop} == {k: v for k, v in old.json().items() if k not in drop}
    assert new.json()["format_version"] == 1
    # Each sub-command takes only its own options: --context means nothing to a step bisection.
    res = run_cli("bisect", "steps", recs["toy"], "--context", 2)
    assert res.code == 2 and "--context" in res.err and "Traceback" not in res.err
    res = run_cli("bisect", "layers", recs["toy"], "--rank", 0)
    assert res.code == 2 and "--between" in res.err


# -- reproduce the recording --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hidden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank recorded with HIDDEN_DOUBLE=1 in its environment (tests/hidden_engine.py): the
    recorded config does not say so, so a plain re-run does not reproduce the recording."""
    out = tmp_path_factory.mktemp("hidden") / "rec"
    args = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step", "tests.hidden_engine:HiddenEngine.step",
            "--state", "state_tensors", "--config", "replay_config", "--factory", "tests.hidden_engine:build",
            "--keyframe-every", "2", "--", sys.executable, "-m", "tests.hidden_engine", "4"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HIDDEN_DOUBLE="1", **ONE_RANK)
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.timeout(400)
@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_config_reproduce_finds_what_the_recording_environment_had(hidden: Path, run_cli: Any) -> None:
    assert "HIDDEN_DOUBLE" not in os.environ  # the probes re-run without it
    res = run_cli("bisect", "config", hidden, "--rank", 0, "--step", 2, "--no-save", "--json")
    assert res.code == 0, res.err
    d = res.json()
    # The only rank, run eagerly: nothing to compare with but the recording itself.
    assert d["criterion"] == "reproduce" and d["reference"] is None
    assert d["status"] == "done" and d["minimal"] == ["double=true"]  # seed_offset, tried too, is not needed
    assert d["tried"][0]["toggles"] == [] and d["tried"][0]["outcome"] == "differs"
    text = run_cli("bisect", "config", hidden, "--rank", 0, "--step", 2, "--no-save")
    assert text.code == 0 and text.out.splitlines()[0].startswith("rank 0, step 2: the smallest set of toggles that makes it "
                                                                  "match the recording")


@pytest.mark.e2e
@pytest.mark.smoke  # kept in `make test`: record a real process, read it, re-run it, bisect it
def test_smoke_record_info_and_bisect_a_rerun(hidden: Path, run_cli: Any) -> None:
    info = run_cli("info", hidden, "--json")
    assert info.code == 0 and [r["steps"] for r in info.json()["ranks"]] == [4]
    d = bisect(run_cli, hidden, "--steps", "--against-rerun", "--rank", 0, "--no-save")
    assert (d["how"], d["first"], d["field"]) == ("rerun", 0, "output.logits")  # HIDDEN_DOUBLE is not set here
    d = run_cli("bisect", "steps", hidden, "--against-rerun", "--exhaustive", "--set", "double=true", "--no-save", "--json")
    assert d.code == 0 and d.json()["first"] is None and len(d.json()["probes"]) == 2  # keyframes every 2 steps


def test_a_search_that_re_ran_only_the_last_interval_says_so() -> None:
    """"no departure from the recording found" after re-running one interval of ten: a step that
    computed otherwise once, earlier, departs in its own interval only (each starts from its
    keyframe), and the note blamed nondeterminism. The verdict says what was re-run."""
    from replay.bisect.steps import StepsBisection
    from replay.states import StepsHow

    r = StepsBisection(recording="rec", part="run-000", how=StepsHow.RERUN, ranks=[1], first=None, mode="eager",
                       steps_rerun=1, steps_total=10, exhaustive=False)
    v = r.verdict()
    assert "no departure found in the last keyframe interval, the only one re-run" in v and "--exhaustive" in v, v
    r.exhaustive = True
    assert r.verdict().endswith("no departure from the recording found (every keyframe interval re-ran as recorded)")
