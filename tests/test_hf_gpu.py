"""The Hugging Face Llama example (examples/hf_llama) on GPUs: CUDA graphs captured by hand and
through ``torch.compile(mode="reduce-overhead")``, recorded and re-run bit-exactly in cudagraph
mode; two-GPU tensor parallelism (DTensor over NCCL) recorded, re-run with live collectives, one
rank re-run alone, and a bug planted on rank 1 found at its step and module.

Run with ``make test-gpu`` (``pytest -m "gpu or multigpu" tests/test_hf_gpu.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
PLANTED_AT = 4
MODEL = ["--preset", "small", "--dtype", "bfloat16", "--device", "cuda"]
RECIPE = [
    "--step", "examples.hf_llama.engine:HFDecoder.decode_step", "--state", "replay_state",
    "--config", "replay_config", "--factory", "examples.hf_llama.engine:build", "--modules", "model",
    "--keyframe-every", "4",
]


def _record(out: Path, *run_args: str, collectives: str = "auto") -> Path:
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", *RECIPE, "--collectives", collectives,
           "--", sys.executable, "-m", "examples.hf_llama.run", "--steps", str(STEPS), *MODEL, *run_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=900)
    assert p.returncode == 0, p.stderr.decode()[-4000:]
    return out


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


def _json(run_cli, *args: object) -> dict:
    res = run_cli(*args, "--json", "--no-save") if args[0] != "info" else run_cli(*args, "--json")
    assert res.code == 0, res.err
    return res.json()


def _step_modes(rec: Path, rank: int = 0) -> list[str]:
    from replay.format.reader import Recording

    with Recording(rec) as r:
        rf = r["run-000"][rank]
        return [rf.step(s).mode for s in range(rf.n_steps)]


def _graph_steps(run_cli, rec: Path) -> list[int]:
    return [r["graph_steps"] for r in _json(run_cli, "info", rec)["ranks"]]


# -- one GPU: CUDA graphs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def manual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("hf-gpu") / "manual", "--graphs", "manual")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("hf-gpu") / "compile", "--graphs", "compile")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["manual", "compiled"])
def test_graph_variant_reruns_bit_exactly(variant, request, run_cli):
    """Every decode step replayed a CUDA graph when recorded, and the re-run in cudagraph mode
    (the engine's own runner, rebuilt by the factory) reproduces the recorded logits bit for bit,
    from a keyframe and after fast-forwarding through the recorded inputs."""
    rec = request.getfixturevalue(variant)
    modes = _step_modes(rec)
    if variant == "manual":
        assert modes == ["graph"] * STEPS
    else:
        # torch.compile's CUDA graph trees run a graph's first calls without replaying it (warm-up,
        # then capture): the recording says so for those steps; every later step replayed one.
        assert modes[2:] == ["graph"] * (STEPS - 2), modes
    data = _json(run_cli, "step", rec, "--rank", 0, "--step", 6, "--mode", "both", "--device", "cuda:0", "--repeat", 2)
    graph = data["modes"]["cudagraph"]
    assert graph["departed"] is None and graph["error"] is None
    assert graph["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert graph["repeats_equal"] is True
    # Eager against the graph: reported, not asserted (torch.compile's kernels are not eager's).
    assert data["modes"]["eager"]["error"] is None


@pytest.mark.gpu
def test_manual_graph_bisect_eager_against_cudagraph(manual, run_cli):
    """Taps inside the hand-captured graph report the HF model's modules on the graph side too."""
    data = _json(run_cli, "bisect", manual, "--rank", 0, "--step", 6, "--between", "eager,cudagraph", "--device", "cuda:0")
    sides = {s["label"]: s for s in data["sides"]}
    assert sides["cudagraph"]["graph_events"] > 0
    assert sides["cudagraph"]["reproduces_recording"]
    assert any(m["module"] == "model.norm" for m in data["modules"])


# -- two GPUs: tensor parallelism over NCCL --------------------------------------------------------


@pytest.fixture(scope="module")
def tp_nccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("hf-gpu") / "tp", "--ranks", "2", "--tp", "--perturb-rank", "1",
                   "--perturb-at", str(PLANTED_AT), collectives="full")


@pytest.fixture(scope="module")
def tp_nccl_graphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("hf-gpu") / "tp-graphs", "--ranks", "2", "--tp", "--graphs", "manual")


@pytest.mark.multigpu
def test_tp_nccl_reruns_with_live_collectives(tp_nccl, run_cli):
    data = _json(run_cli, "step", tp_nccl, "--ranks", "0-1", "--step", 6, "--mode", "eager", "--devices", "cuda:0,cuda:1")
    results = data["results"]
    assert [r.get("error") for r in results] == [None, None]
    for r in results:
        assert r["collectives"] == "live"
        assert r["modes"]["eager"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"


@pytest.mark.multigpu
def test_tp_nccl_planted_bug_found_at_step_and_module(tp_nccl, run_cli):
    info = _json(run_cli, "info", tp_nccl)
    d = info["first_divergence"]
    assert (d["step"], d["ranks"]) == (PLANTED_AT, [1])
    # Rank 1 alone on one GPU (fake process group, recorded all-reduces): its own bits.
    eager = _json(run_cli, "step", tp_nccl, "--rank", 1, "--step", PLANTED_AT + 1, "--mode", "eager",
                  "--device", "cuda:0")["modes"]["eager"]
    assert eager["collective_mismatches"] == []
    assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    data = _json(run_cli, "bisect", tp_nccl, "--between", "rank:0,rank:1", "--device", "cuda:0")
    assert data["step"] == PLANTED_AT
    assert data["first_module"] == "model.norm"


@pytest.mark.multigpu
def test_tp_nccl_under_cuda_graphs_reruns_with_live_collectives(tp_nccl_graphs, run_cli):
    """All-reduces captured inside the graphs are not recorded one by one; all ranks re-run
    together, each capturing its graph with live NCCL collectives, reproduce the recording."""
    assert _graph_steps(run_cli, tp_nccl_graphs) == [STEPS, STEPS]
    data = _json(run_cli, "step", tp_nccl_graphs, "--ranks", "0-1", "--step", 6, "--mode", "cudagraph",
                 "--devices", "cuda:0,cuda:1")
    results = data["results"]
    assert [r.get("error") for r in results] == [None, None]
    for r in results:
        assert r["modes"]["cudagraph"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"
