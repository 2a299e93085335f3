"""No "bit for bit", "equal" or "reproduces" without a comparison behind it (issue 14, item 4).

Each test plants, at re-run time, one way a re-run can fail to be a comparison (a catch-up step
that raises, the requested step raising, outputs the recording cannot be compared with, a step
whose recording kept no output) and checks that `replay step` / `replay bisect` say so and exit
with RerunError's code instead of reporting the step as reproduced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RERUN_ERROR = 7


def _record(out: Path, *extra: str, steps: int = 10, none: bool = False) -> None:
    cmd = [sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--keyframe-every", "4", *extra,
           "--", sys.executable, "-m", "tests.rerun_engine", str(steps), *(["none"] if none else [])]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]


ENGINE = ("--step", "tests.rerun_engine:Engine.step", "--state", "state", "--config", "replay_config",
          "--factory", "tests.rerun_engine:build")


@pytest.fixture(scope="module")
def recs(tmp_path_factory):
    base = tmp_path_factory.mktemp("truthful")
    _record(base / "engine", *ENGINE)
    _record(base / "none", *ENGINE, none=True)
    return base


def test_control_reruns_bit_for_bit(recs, run_cli):
    """The same recording re-runs bit for bit when nothing is planted: the tests below can fail."""
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 6, "--mode", "eager", "--no-save")
    assert res.code == 0, res.err
    assert "steps 4..5 re-ran bit for bit as recorded" in res.out
    assert "bitwise equal" in res.out


def test_numerics_context_is_restored(recs, run_cli):
    """The program ran its loop under sdpa_kernel([MATH]); the step's bits depend on the flash flag.
    `replay step` runs in a process where flash is on: only a restored context reproduces them."""
    assert torch.backends.cuda.flash_sdp_enabled()
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 6, "--mode", "eager", "--json", "--no-save")
    assert res.code == 0, res.err
    eager = res.json()["modes"]["eager"]
    assert eager["numerics"] == {"recorded": True, "differences": []}
    assert eager["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert torch.backends.cuda.flash_sdp_enabled()  # and put back afterwards


def test_catch_up_step_that_raises_stops_the_rerun(recs, run_cli):
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 7, "--mode", "eager", "--set", "raise_at=5", "--no-save")
    assert res.code == RERUN_ERROR
    error = [ln for ln in res.err.splitlines() if ln.startswith("replay: error:")]
    assert len(error) == 1 and "catch-up step 5 raised RuntimeError" in error[0]
    assert "bit for bit" not in res.out and "bitwise equal" not in res.out


def test_requested_step_that_raises_is_not_reproduced(recs, run_cli):
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 6, "--mode", "eager", "--set", "raise_at=6",
                  "--json", "--no-save")
    assert res.code == RERUN_ERROR
    data = res.json()
    assert data["modes"]["eager"]["error"].startswith("RuntimeError")
    assert "raised RuntimeError" in data["problem"]
    assert all(v["verdict"] != "bitwise equal" for v in data["verdicts"])


def test_output_the_rerun_does_not_return_is_a_difference(recs, run_cli):
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 6, "--mode", "eager", "--set", "rename=1",
                  "--json", "--no-save")
    data = res.json()
    eager = data["modes"]["eager"]
    # The catch-up departs at once (its recorded logits are not returned) ...
    assert eager["departed"]["step"] == 4 and "not returned" in eager["departed"]["field"]
    # ... and the step itself is "different" on logits, never equal, never silently skipped.
    assert eager["vs_recording"]["logits"]["verdict"] == "different"
    assert "other" not in eager["vs_recording"]  # nothing recorded of that name: no verdict on it
    assert res.code == 0  # a re-run that ran and differs is a result, not a failure to re-run


def test_step_with_no_recorded_output_is_not_called_equal(recs, run_cli):
    res = run_cli("step", recs / "none", "--rank", 0, "--step", 6, "--mode", "eager", "--no-save")
    assert res.code == RERUN_ERROR
    assert "bit for bit as recorded" not in res.out
    assert "had no recorded output to compare with (steps 4, 5)" in res.out
    assert "no output of step 6 could be compared" in res.err


def test_bisect_side_that_raises_is_not_all_equal(recs, run_cli):
    res = run_cli("bisect", recs / "engine", "--rank", 0, "--step", 6, "--between", "recorded,rerun",
                  "--set", "raise_at=6", "--no-save")
    assert res.code == RERUN_ERROR, res.err
    assert "bitwise equal" not in res.out.splitlines()[0]
    assert "rerun raised RuntimeError" in res.out


def test_bisect_catch_up_that_raises_stops(recs, run_cli):
    res = run_cli("bisect", recs / "engine", "--rank", 0, "--step", 6, "--between", "recorded,rerun",
                  "--set", "raise_at=5", "--no-save")
    assert res.code == RERUN_ERROR
    assert "catch-up step 5 raised" in res.err


def test_python_step_counter_is_restored_from_the_keyframe(recs, run_cli):
    """The engine's Python counter (``steps_done``, in its outputs) comes back with the keyframe:
    without it the re-run of step 5 from the keyframe at 4 would compute other bits (issue 17)."""
    res = run_cli("step", recs / "engine", "--rank", 0, "--step", 5, "--mode", "eager", "--no-save", "--json")
    assert res.code == 0, res.err
    d = res.json()
    assert d["keyframe"] == 4 and d["format"] >= 1
    assert any("steps_done=4" in n for n in d["notes"]), d["notes"]
    assert d["modes"]["eager"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"


def test_bisect_steps_over_steps_with_nothing_to_compare_is_not_as_recorded(recs, run_cli):
    """A recording that kept no output (every step returned None): re-running it compares
    nothing, so `bisect steps --against-rerun` must not say the steps re-ran as recorded."""
    res = run_cli("bisect", "steps", recs / "none", "--against-rerun", "--rank", 0, "--no-save")
    assert res.code == 7, (res.code, res.out, res.err)
    assert "as recorded" not in res.out and "no departure" not in res.out
    assert "nothing to compare" in res.err or "nothing to compare" in res.out


def test_bisect_steps_control_finds_a_planted_departure(recs, run_cli):
    """The same bisection on the engine recording does compare, and finds a planted failure."""
    res = run_cli("bisect", "steps", recs / "engine", "--against-rerun", "--rank", 0, "--no-save", "--set", "raise_at=6",
                  "--json")
    assert res.code == 0, res.err
    d = res.json()
    assert d["first"] == 6 and d["field"] == "error", d
