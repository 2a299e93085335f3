"""A decode loop run as tasks of a process pool (``multiprocessing.Pool``): each task builds its
own model and decodes a prompt. The pool gives each task to whichever worker is free, so a
re-launch of the program may run the recorded task in another worker, or as another of a worker's
tasks: ``replay step`` finds it by its model, and ``with Pool(...)``'s terminate keeps each
worker's end marker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest

from replay.record.launch import task_pool

ROOT = Path(__file__).resolve().parents[1]

# Each task's weights are seeded by its prompt: a task run on another worker than when recorded
# must still be re-run with its own weights (before, the worker's name chose the task, and the
# verdict was "not reproduced ... other weights", or a failure, depending on the pool's order).
_POOL = textwrap.dedent("""
    import multiprocessing as mp, torch, torch.nn as nn
    V, D = 32, 16

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D); self.l1 = nn.Linear(D, D); self.out = nn.Linear(D, V)

        def forward(self, ids):
            return self.out(torch.tanh(self.l1(self.emb(ids).mean(1))))

    def work(prompt):
        torch.manual_seed(prompt[0]); torch.set_num_threads(1)
        m = Tiny().eval(); ids = torch.tensor([prompt]); out = []
        with torch.no_grad():
            for _ in range(6):
                t = m(ids).argmax(-1, keepdim=True); ids = torch.cat([ids, t], 1); out.append(t.item())
        return out

    if __name__ == "__main__":
        import os
        with mp.get_context("spawn").Pool(int(os.environ.get("POOL_WORKERS", "2"))) as p:
            print(p.map(work, [[1, 2], [3, 4, 5], [7]]))
""")


def test_a_task_pools_worker_loop_is_named():
    assert task_pool() is None
    with ThreadPool(1) as pool:
        assert pool.apply(task_pool) == "multiprocessing.pool"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _replay(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.e2e
def test_each_pool_task_is_re_run_with_its_own_model(tmp_path):
    (tmp_path / "pool_engine.py").write_text(_POOL)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "pool_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    v = _replay("verify", "rec", cwd=tmp_path)
    assert v.returncode == 0 and "INCOMPLETE" not in v.stdout, v.stdout + v.stderr
    parts = sorted(p.name for p in (tmp_path / "rec").iterdir() if p.name.startswith("run-"))
    assert len(parts) == 3, parts
    for part in parts:
        r = _replay("step", "rec", "--part", part, "--rank", "0", "--step", "3", "--no-save", cwd=tmp_path)
        assert r.returncode == 0, f"{part}: {r.stdout}{r.stderr}"
        assert r.stdout.startswith("reproduced:"), f"{part}: {r.stdout}"
        assert "other weights" not in r.stdout, r.stdout
        # What a task found by its weights cannot stand for (trial 22: a global the task sets).
        assert "ran as a task of a process pool" in r.stdout, r.stdout


@pytest.mark.e2e
def test_diff_of_two_runs_of_a_pool_pairs_tasks_by_model_and_never_calls_a_call_offset_different(tmp_path):
    """Trial 22: two runs of one deterministic pool program (two workers, then one) were
    "different ... weights differ" (parts paired by name: another task), and the same task,
    its worker's first in one run and second in the other, "different" (its steps numbered from
    the step's second call in one run, its first in the other)."""
    (tmp_path / "pool_engine.py").write_text(_POOL)
    for name, workers in (("two", "2"), ("one", "1")):
        rec = _replay("record", "--quiet", "--out", name, "--", sys.executable, "pool_engine.py", cwd=tmp_path, POOL_WORKERS=workers)
        assert rec.returncode == 0, rec.stderr
    d = _replay("diff", "two", "one", cwd=tmp_path)
    head = d.stdout.splitlines()[0]
    assert not head.startswith("different"), d.stdout
    assert "weights differ" not in d.stdout, d.stdout
    assert "steps numbered from other calls" in d.stdout, d.stdout
