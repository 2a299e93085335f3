"""Re-running steps of an engine replay has never been told about (tests/engines/tinyllm), no flags.

Recorded with `replay record -- python generate.py ...` and nothing else, then re-run with
`replay step` from another directory, with nothing on PYTHONPATH but replay itself: the
recording names no factory, so the recorded program is started again in replay mode and is its
own factory. Covered: the plain decode loop, the torch.compile'd step (eager and compiled again),
draft + target speculative decoding (two streams in one part), one tensor-parallel rank alone,
code changed since the recording (a step that raises, weights that differ), and an nn.Module
class named as the step with a factory (its forward, never its constructor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ENGINE = Path(__file__).resolve().parent / "engines" / "tinyllm"
ROOT = Path(__file__).resolve().parent.parent
RERUN_ERROR = 7


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
    env["PYTHONPATH"] = str(ROOT)  # replay itself; never the engine's directory
    return env


def _record(out: Path, engine: Path, *args: str, torchrun: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "generate.py", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "generate.py", *args]
    return subprocess.Popen([sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--", *cmd],
                            cwd=engine, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _step(rec: Path, cwd: Path, *args: Any) -> tuple[int, dict[str, Any] | None, str]:
    """`replay step REC ... --json --no-save`, run in ``cwd``: (exit code, JSON, stderr)."""
    p = subprocess.run([sys.executable, "-m", "replay", "step", str(rec), *map(str, args), "--json", "--no-save"],
                       cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    try:
        data = json.loads(p.stdout) if p.stdout.strip() else None
    except ValueError:
        data = None
    return p.returncode, data, p.stderr


@pytest.fixture(scope="module")
def recs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("foreign")
    # Copies of the engine that the tests change after recording (code changed since).
    for name in ("raises", "weights"):
        shutil.copytree(ENGINE, base / f"engine-{name}", ignore=shutil.ignore_patterns("__pycache__"))
    jobs = {
        "plain": _record(base / "plain", ENGINE, "--tokens", "7"),
        "compiled": _record(base / "compiled", ENGINE, "--tokens", "6", "--compile", "--compile-backend", "eager"),
        "draft": _record(base / "draft", ENGINE, "--tokens", "8", "--draft"),
        "raises": _record(base / "raises", base / "engine-raises", "--tokens", "7"),
        "weights": _record(base / "weights", base / "engine-weights", "--tokens", "7"),
    }
    for name, p in jobs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, (name, err[-2000:])
    model = base / "engine-raises" / "model.py"
    src = model.read_text()
    anchor = "    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:\n"
    assert anchor in src
    model.write_text(src.replace(anchor, anchor + "        if int(input_pos.max()) >= 8:\n"
                                 "            raise RuntimeError('changed since the recording')\n"))
    gen = base / "engine-weights" / "model.py"
    src = gen.read_text()
    anchor = "    if world == 1:\n        return full\n"
    assert anchor in src
    gen.write_text(src.replace(anchor, "    with torch.no_grad():\n        full.norm.weight.add_(1e-3)\n" + anchor))
    (base / "elsewhere").mkdir()
    return {**{k: base / k for k in jobs}, "cwd": base / "elsewhere"}


def _eager(data: dict[str, Any]) -> dict[str, Any]:
    return data["modes"]["eager"]


def test_plain_loop_reruns_bit_for_bit_from_another_directory(recs: dict[str, Path]) -> None:
    code, data, err = _step(recs["plain"], recs["cwd"], "--rank", 0, "--step", 4)
    assert code == 0, err
    assert data is not None and data["problem"] is None
    eager = _eager(data)
    assert list(data["modes"]) == ["eager"]  # CPU recording, CPU machine: eager only, by default
    assert eager["departed"] is None and eager["caught_up"], eager
    assert eager["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    assert eager["numerics"]["recorded"] is True and eager["numerics"]["differences"] == []
    assert data["weights"]["same"] is True and data["weights"]["checked"] > 0
    assert any("re-launched program" in n for n in data["notes"])  # no factory: the program was its own


def test_compiled_step_reruns_eager_and_compiled(recs: dict[str, Path]) -> None:
    code, data, err = _step(recs["compiled"], recs["cwd"], "--rank", 0, "--step", 3)
    assert code == 0, err
    assert data is not None
    eager = _eager(data)
    assert "uncompiled" in eager["ran_as"]
    assert all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    code, data, err = _step(recs["compiled"], recs["cwd"], "--rank", 0, "--step", 3, "--mode", "compiled")
    assert code == 0, err
    run = data["modes"]["compiled"]
    assert run["ran_as"].startswith("torch.compile(") and "fullgraph=True" in run["ran_as"]
    assert run["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in run["vs_recording"].values())


def test_draft_and_target_rebuild_the_stream_that_holds_the_step(recs: dict[str, Path]) -> None:
    from replay.format.reader import Recording
    from replay.rerun.streams import stream_of

    with Recording(recs["draft"]) as rec:
        rf = rec["run-000"][0]
        by_stream: dict[str, list[int]] = {}
        for s in range(rf.n_steps):
            by_stream.setdefault(stream_of(rf, s) or "", []).append(s)
    assert len(by_stream) == 2, by_stream
    for name, steps in by_stream.items():
        step = steps[len(steps) // 2]
        code, data, err = _step(recs["draft"], recs["cwd"], "--rank", 0, "--step", step)
        assert code == 0, err
        assert data["stream"] == name
        eager = _eager(data)
        # Only the stream's own steps were caught up, and every one of them matched.
        assert set(eager["caught_up"]) <= set(steps) and eager["departed"] is None
        assert all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    other = next(n for n in by_stream if n != data["stream"])
    code, _, err = _step(recs["draft"], recs["cwd"], "--rank", 0, "--step", step, "--stream", other)
    assert code == 2 and f"stream {data['stream']!r}" in err


def test_code_that_raises_since_the_recording_stops_the_rerun(recs: dict[str, Path]) -> None:
    code, data, err = _step(recs["raises"], recs["cwd"], "--rank", 0, "--step", 5)
    assert code == RERUN_ERROR
    assert "catch-up step" in err and "RuntimeError: changed since the recording" in err
    assert data is None or "bit for bit" not in json.dumps(data)


def test_weights_that_differ_are_named(recs: dict[str, Path]) -> None:
    code, data, err = _step(recs["weights"], recs["cwd"], "--rank", 0, "--step", 3)
    assert code == 0, err
    assert data["weights"]["same"] is False and data["weights"]["differ"] == ["norm.weight"]
    assert any(v["verdict"] != "bitwise equal" for v in _eager(data)["vs_recording"].values())


def _bisect(rec: Path, cwd: Path, *args: Any) -> tuple[int, dict[str, Any] | None, str]:
    p = subprocess.run([sys.executable, "-m", "replay", "bisect", *map(str, args[:1]), str(rec), *map(str, args[1:]),
                        "--json", "--no-save"], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    try:
        data = json.loads(p.stdout) if p.stdout.strip() else None
    except ValueError:
        data = None
    return p.returncode, data, p.stderr


def test_bisect_steps_without_a_factory_relaunches_and_scans_every_stream(recs: dict[str, Path]) -> None:
    """No factory: `bisect steps --against-rerun` re-launches the program, once per stream of
    draft + target, and compares every step; code changed since the recording is found."""
    code, data, err = _bisect(recs["draft"], recs["cwd"], "steps", "--against-rerun", "--rank", 0)
    assert code == 0, err
    assert data["first"] is None and data["exhaustive"] is True, data
    assert sum("re-launched program" in n for n in data["notes"]) == 2, data["notes"]  # one launch per stream
    assert data["steps_rerun"] >= data["steps_total"] - 2, data
    code, data, err = _bisect(recs["weights"], recs["cwd"], "steps", "--against-rerun", "--rank", 0)
    assert code == 0, err
    assert data["first"] == 0 and data["field"].startswith("output."), data  # the changed norm weight: from step 0


def test_bisect_layers_and_config_without_a_factory_say_so_in_one_line(recs: dict[str, Path]) -> None:
    for args in (("layers", "--between", "eager,cudagraph", "--rank", 0, "--step", 3), ("config", "--rank", 0, "--step", 3)):
        code, data, err = _bisect(recs["plain"], recs["cwd"], *args)
        assert code != 0 and "needs a factory" in err and "Traceback" not in err, (args, err)
        assert data is None or "equal" not in json.dumps(data)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_tensor_parallel_rank_reruns_alone(tmp_path: Path) -> None:
    p = _record(tmp_path / "tp", ENGINE, "--tokens", "6", torchrun=2)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    code, data, err = _step(tmp_path / "tp", tmp_path, "--rank", 1, "--step", 3)
    assert code == 0, err
    eager = _eager(data)
    assert eager["collective_mismatches"] == []
    assert all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    # --ranks with no factory: each rank in its own re-launched program.
    p2 = subprocess.run([sys.executable, "-m", "replay", "step", str(tmp_path / "tp"), "--ranks", "0-1", "--step", "3", "--json"],
                        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stderr
    results = json.loads(p2.stdout)["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(v["verdict"] == "bitwise equal" for r in results for v in r["modes"]["eager"]["vs_recording"].values())
    # The text leads with one verdict over the ranks (before: only a line per rank).
    p3 = subprocess.run([sys.executable, "-m", "replay", "step", str(tmp_path / "tp"), "--ranks", "0-1", "--step", "3"],
                        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert p3.stdout.splitlines()[0] == ("reproduced: step 3 of rank(s) 0, 1, each alone against its own recording, its "
                                         "collectives answered from the recording"), p3.stdout


def test_module_class_step_reruns_its_forward_with_a_factory(tmp_path: Path, run_cli: Any) -> None:
    """`--step mod:Class` (an nn.Module) is its instances' forward, on re-run too (issue 14, item 4)."""
    out = tmp_path / "tiny"
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--keyframe-every", "2",
           "--step", "tests.rerun_engine:Tiny", "--factory", "tests.rerun_engine:build_tiny",
           "--", sys.executable, "-m", "tests.rerun_engine", "6"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = run_cli("step", out, "--rank", 0, "--step", 5, "--json", "--no-save")
    assert res.code == 0, res.err
    data = res.json()
    eager = data["modes"]["eager"]
    assert eager["error"] is None and eager["caught_up"] == [4]
    assert eager["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_reduce_overhead_step_reruns_bit_exact_in_cudagraph_mode(tmp_path: Path) -> None:
    """torch.compile(mode="reduce-overhead") recorded on a GPU; a step after the CUDA graph trees'
    warm-up re-run with --mode cudagraph (torch.compile's own graphs again) to the recorded bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    p = _record(tmp_path / "ro", ENGINE, "--tokens", "12", "--compile", "--compile-mode", "reduce-overhead", "--device", "cuda")
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-2000:]
    code, data, err = _step(tmp_path / "ro", tmp_path, "--rank", 0, "--step", 8, "--mode", "cudagraph", "--device", "cuda:0")
    assert code == 0, err
    run = data["modes"]["cudagraph"]
    assert "reduce-overhead" in run["ran_as"]
    assert run["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in run["vs_recording"].values()), run


def _bisect_tp(tmp_path: Path, run_cli: Any, config: dict) -> dict[str, Any]:
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--keyframe-every", "2",
           "--step", "tests.tp_engine:TPModel", "--config", "replay_config", "--factory", "tests.tp_engine:build",
           "--collectives", "full", "--", sys.executable, "-m", "tests.tp_engine", "5", json.dumps(config)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = run_cli("bisect", out, "--between", "rank:0,rank:1", "--step", 3, "--json", "--no-save")
    assert res.code == 0, res.err
    return res.json()


def test_plain_tp_bisect_tells_a_replicated_weight_from_a_shard(tmp_path: Path, run_cli: Any) -> None:
    """Rank 1's replicated norm weight is off by 1e-3: the norm, not a shard, makes the difference."""
    from replay.bisect.layers import LayersBisection  # noqa: F401 - the module under test

    d = _bisect_tp(tmp_path, run_cli, {"seed": 1, "perturb_rank": 1})
    norm = next(m for m in d["modules"] if m["name"] == "norm")
    assert norm["rank_local"] is False and norm["inputs_equal"] is True and norm["verdict"] != "bitwise equal"
    assert d["first"] == "norm"
    shards = {m["name"]: m for m in d["modules"] if m["name"] in ("up", "down")}
    assert all(m["rank_local"] for m in shards.values())
    assert any("norm.weight" in n and "not shards" in n for n in d["notes"])


def test_plain_tp_bisect_never_says_nothing_differs_over_differing_shards(tmp_path: Path, run_cli: Any) -> None:
    d = _bisect_tp(tmp_path, run_cli, {"seed": 1})
    assert d["first"] is None
    assert any(m["rank_local"] and m["verdict"] != "bitwise equal" for m in d["modules"])
    res = run_cli("bisect", tmp_path / "tp", "--between", "rank:0,rank:1", "--step", 3, "--no-save")
    head = res.out.splitlines()[0]
    assert "bitwise equal" not in head and "none of the" not in head
    assert "rank-local (shard) outputs differ" in head


def test_program_that_spawns_its_ranks_reruns_one_rank(tmp_path: Path) -> None:
    """A script that starts its own ranks (mp.spawn), its engine class in __main__, no factory: the
    re-launched program stops every rank but the one re-run, which takes its engine at its first step."""
    out = tmp_path / "spawned"
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step", "__main__:MyEngine.step",
           "--state", "state", "--", sys.executable, "tests/plain_engine_script.py", "8"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    code, data, err = _step(out, tmp_path, "--rank", 1, "--step", 5)
    assert code == 0, err
    eager = _eager(data)
    assert eager["caught_up"] and eager["departed"] is None
    assert eager["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())


def test_digest_only_collectives_without_a_factory_name_a_remedy_that_works(tmp_path: Path) -> None:
    """Without a factory, ``--ranks`` re-launches each rank alone on its recorded collectives, so a
    digest-only recording cannot be re-run that way: the line says so and names what does work
    (it used to advise ``--ranks``, the very command that failed)."""
    out = tmp_path / "digests"
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step", "__main__:MyEngine.step",
           "--state", "state", "--collectives", "digest", "--", sys.executable, "tests/plain_engine_script.py", "4"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    code, _, err = _step(out, tmp_path, "--ranks", "0-1", "--step", 2)
    assert code == 7
    line = err.strip().splitlines()[-1]
    assert "--collectives full" in line and "--factory" in line
