"""`replay record -- CMD` on programs not written for replay: scripts, pytest, torchrun, two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replay import open_recording
from replay.rerun.multi import free_port

ROOT = Path(__file__).resolve().parents[1]


def replay_cmd(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e  # multi-process, 35-90 s on two loaded cores: `make test-e2e`
def test_plain_script_records_with_step_and_exit_code_passes_through(tmp_path):
    out = tmp_path / "rec"
    p = replay_cmd("record", "--out", str(out), "--step", "plain_engine_script:MyEngine.step", "--state", "state",
                   "--", sys.executable, str(ROOT / "tests" / "plain_engine_script.py"), "8",
                   env={"PERTURB": "1", "EXIT_CODE": "5"})
    assert p.returncode == 5, p.stderr
    assert "first divergence        step 4: output.logits differs on rank(s) 1" in p.stderr
    with open_recording(out) as rec:
        part = rec["run-000"]
        assert sorted(part) == [0, 1]
        rf = part[1]
        assert rf.n_steps == 8 and rf.complete
        assert rf.keyframe_steps()[0] == 0
        t = rf.full()
        assert t.collectives.size == 8  # one all_reduce a step, recorded with its digests
        args = json.loads(rf.tables.string(int(rf.tables.steps["args"][3])))
        assert {k: v for k, v in args.items() if not k.startswith("__")} == {"pos": 3}  # issue 14: + __numerics__
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exit_code"] == 5 and manifest["status"] == "complete"


@pytest.mark.e2e  # multi-process, 35-90 s on two loaded cores: `make test-e2e`
def test_second_engine_in_the_same_process_group_is_a_new_part(tmp_path, run_cli):
    out = tmp_path / "two"
    p = replay_cmd("record", "--out", str(out), "--quiet", "--step", "plain_engine_script:MyEngine.step", "--state", "state",
                   "--", sys.executable, str(ROOT / "tests" / "plain_engine_script.py"), "5", env={"TWO_ENGINES": "1"})
    assert p.returncode == 0, p.stderr
    data = run_cli("info", out, "--json").json()
    assert [q["name"] for q in data["parts"]] == ["run-000", "run-001"]
    for name in ("run-000", "run-001"):
        part = run_cli("info", out, "--part", name, "--json").json()
        assert [r["steps"] for r in part["ranks"]] == [5, 5]


@pytest.fixture(scope="module")
def pytest_recording(tmp_path_factory):
    """A pytest file whose two test cases each start a two-rank run: one part per run."""
    d = tmp_path_factory.mktemp("pt")
    (d / "test_two_runs.py").write_text(textwrap.dedent(f"""
        import json, subprocess, sys
        def _run(perturb):
            env = dict(__import__("os").environ, PERTURB=perturb)
            subprocess.run([sys.executable, {str(ROOT / 'tests' / 'plain_engine_script.py')!r}, "6"], check=True, env=env)
        def test_clean():
            _run("0")
        def test_drifting():
            _run("1")
    """))
    (d / "pyproject.toml").write_text('[tool.replay]\nsteps = ["plain_engine_script:MyEngine.step"]\nstate = "state"\n')
    out = d / "rec"
    p = replay_cmd("record", "--out", str(out), "--quiet", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "test_two_runs.py", cwd=d)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.mark.e2e  # multi-process, 35-90 s on two loaded cores: `make test-e2e`
def test_one_part_per_run_and_info_names_the_one_that_diverged(pytest_recording, run_cli):
    data = run_cli("info", pytest_recording, "--json").json()
    parts = {p["name"]: p["diverged"] for p in data["parts"]}
    assert parts == {"run-000": False, "run-001": True}
    assert data["part"] == "run-001"  # the default part is the one that diverged
    assert data["first_divergence"]["step"] == 4 and data["first_divergence"]["ranks"] == [1]
    clean = run_cli("info", pytest_recording, "--part", "run-000", "--json").json()
    assert clean["first_divergence"] is None
    res = run_cli("info", pytest_recording, "--part", "run-009")
    assert res.code == 2 and "run-000, run-001" in res.err


@pytest.mark.e2e  # multi-process, 35-90 s on two loaded cores: `make test-e2e`
def test_two_simulated_nodes_share_one_recording(tmp_path, run_cli):
    """Two torchrun launches with distinct node ranks and one --out: one recording, no clobbering."""
    out = tmp_path / "shared"
    script = tmp_path / "node_script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        class Engine:
            def step(self, x):
                y = x * 2
                dist.all_reduce(y)
                return y
        dist.init_process_group("gloo")
        e = Engine()
        x = torch.ones(3) * dist.get_rank()
        for _ in range(4):
            x = e.step(x) / dist.get_world_size()
        dist.destroy_process_group()
    """))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step", "node_script:Engine.step",
             "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for node in (0, 1)
    ]
    for p in procs:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, e.decode()[-3000:]
    assert (out / "manifest.json").exists() and (out / "manifest.node1.json").exists()
    data = run_cli("info", out, "--json").json()
    assert data["world_size"] == 2 and [r["steps"] for r in data["ranks"]] == [4, 4]
    assert {r["rank"]: r["node_rank"] for r in data["ranks"]} == {0: 0, 1: 1}
    assert len(data["parts"]) == 1


@pytest.mark.e2e  # multi-process, 35-90 s on two loaded cores: `make test-e2e`
def test_check_lockstep_flushes_the_ring_and_can_stop(tmp_path, run_cli):
    out = tmp_path / "ls"
    p = replay_cmd("record", "--out", str(out), "--quiet", "--check-lockstep", "--stop-on-divergence", "--ring", "4",
                   "--step", "plain_engine_script:MyEngine.step", "--state", "state",
                   "--", sys.executable, str(ROOT / "tests" / "plain_engine_script.py"), "8", env={"PERTURB": "1"})
    assert p.returncode != 0  # the program was stopped at the first mismatch
    assert "lockstep: output digests differ at step 4" in p.stderr
    with open_recording(out) as rec:
        rf = rec["run-000"][1]
        t = rf.full()
        assert any("step 4" in e for e in t.events)
        logits_steps = sorted(int(s) for s in t.tensors["step"][t.tensors["kind"] == 4])
        assert 4 in logits_steps  # the ring around the divergent step was written
        assert 5 in rf.keyframe_steps()  # state right after it, so it can be re-run offline
    # info says what the check found while recording (it was in the recording, and shown nowhere)
    info = run_cli("info", out)
    assert "while recording, lockstep: output digests differ at step 4" in info.out, info.out


def test_pytest_plugin_records_a_session(tmp_path):
    (tmp_path / "test_one.py").write_text(textwrap.dedent("""
        import torch
        from tests.toy_engine import ToyEngine
        def test_decode():
            eng = ToyEngine({"seed": 3}, 0, 1)
            tokens = torch.arange(3)
            for pos in range(5):
                tokens = eng.step(tokens, pos)["tokens"]
    """))
    (tmp_path / "pyproject.toml").write_text('[tool.replay]\nsteps = ["tests.toy_engine:ToyEngine.step"]\nstate = "state_tensors"\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    import importlib.metadata

    installed = any(e.name == "replay" for e in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "replay.record.pytest_plugin"]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", *plugin, "--replay-record",
                        "--replay-out", str(tmp_path / "rec"), "-p", "no:cacheprovider", "test_one.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "replay: recorded" in p.stdout
    with open_recording(tmp_path / "rec") as rec:
        rf = next(iter(rec.values()))[0]
        assert rf.n_steps == 5 and rf.complete
