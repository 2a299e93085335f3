"""Soak: 8 CPU ranks recorded for 20,000 steps each through `replay record` (``make soak``).

Runs ``benchmarks/soak.py`` (the script whose figures go in benchmarks/RESULTS.md) and checks
what it measured: the program ended normally, no step was lost on any rank, every rank file is
sealed and complete, ``replay verify`` passes, and each rank's resident memory stayed flat
while it recorded. ``REPLAY_SOAK_RANKS`` / ``REPLAY_SOAK_STEPS`` shrink or grow the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
# Growth of a rank's RSS between 5% of its steps and its last step. A leak of one small
# allocation per step (a kilobyte) would be 20 MB over 20,000 steps.
MAX_GROWTH_MB = 16.0


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_soak_8_ranks_many_steps(tmp_path: Path) -> None:
    ranks = int(os.environ.get("REPLAY_SOAK_RANKS", "8"))
    steps = int(os.environ.get("REPLAY_SOAK_STEPS", "20000"))
    r = subprocess.run(
        [sys.executable, str(SOAK), "--ranks", str(ranks), "--steps", str(steps), "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=7000,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    res = json.loads(r.stdout)
    summary = {k: res[k] for k in ("exit_code", "wall_s", "kept_steps", "problems", "verify_exit", "bytes_written")}
    growth = {x["rank"]: x["rss_growth_mb"] for x in res["ranks"]}
    print(f"\nreplay soak: {ranks} ranks x {steps} steps: {summary}; RSS growth MB per rank {growth}")
    assert res["exit_code"] == 0, (r.stderr[-3000:], (tmp_path / "recorded" / "stderr.txt").read_text()[-3000:])
    assert [x["steps"] for x in res["ranks"]] == [steps] * ranks  # the program completed every step
    assert res["kept_steps"] == {str(k): steps for k in range(ranks)}  # and the recording has each
    assert not res["problems"] and res["verify_exit"] == 0, res
    assert max(growth.values()) < MAX_GROWTH_MB, res["ranks"]
