"""Every command's first line is its verdict (issue 17): what a newcomer reads first says what
was found, not where the recording is or which table follows.

Each command runs through ``click.testing.CliRunner`` on small recordings: a multi-rank one
whose rank 2 drifts from step 3 (written in-process), and two runs of ``tests.runs_engine``, one
with a weight changed (written by ``replay record``, so that they can be re-run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli.main import cli
from tests.factories import make_recording

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e  # two recordings made by `replay record` in subprocesses

# What the first line of each command starts with (or, for bisect steps, says).
VERDICTS: dict[str, str] = {
    "verify": r"^recording is (intact|incomplete|damaged): \d+ rank files?",
    "seal": r"^(sealed \d+ journal|nothing to seal|nothing sealed|\d+ of \d+ journal)",
    "report": r"^(first divergence at step \d+: |no divergence|one rank)",
    "report --against": r"^(the same|different|not shown to be the same)",
    "diff": r"^(the same|different|not shown to be the same)",
    "bisect steps": r"(first disagree at step \d+|agree at every common step)",
    "bisect layers": r"^step \d+, run A \(.*\) vs run B \(.*\): (the difference is made in|first module that differs|all \d+ module)",
    "bisect config": r"^rank \d+, step \d+: (re-run with the recorded settings it already matches|no combination|stopped after|the smallest set)",
}


@pytest.fixture(scope="module")
def recs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("first-line")
    jobs = {}
    for name, bump in (("a", "0"), ("b", "0.01")):
        cmd = [sys.executable, "-m", "replay", "record", "--out", str(base / name), "--quiet", "--keyframe-every", "2",
               "--step", "tests.runs_engine:Net", "--config", "replay_config", "--factory", "tests.runs_engine:build",
               "--", sys.executable, "-m", "tests.runs_engine", "6", bump]
        jobs[name] = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    drift = make_recording(base, ranks=3, steps=6, diverge_at=3, diverge_rank=2, field="tokens", name="drift")
    same = make_recording(base, ranks=3, steps=6, name="same")
    for name, p in jobs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, (name, err.decode()[-2000:])
    return {"a": base / "a", "b": base / "b", "drift": drift, "same": same, "base": base}


def first_line(*args: object) -> tuple[str, int]:
    """The first line of stdout, and the exit code (what the command returned)."""
    res = CliRunner().invoke(cli, [str(a) for a in args], standalone_mode=False, catch_exceptions=False)
    lines = res.stdout.splitlines()
    assert lines, (args, res.stdout, res.stderr)
    return lines[0], int(res.return_value or 0)


def _commands(r: dict[str, Path]) -> list[tuple[str, list[object]]]:
    page = r["base"] / "page.html"
    return [
        ("verify", ["verify", r["drift"]]),
        ("verify", ["verify", r["same"], "--quick"]),
        ("seal", ["seal", r["drift"]]),
        ("report", ["report", r["drift"], "-o", page]),
        ("report", ["report", r["same"], "-o", page]),
        ("report --against", ["report", r["drift"], "--against", r["same"], "-o", page]),
        ("diff", ["diff", r["drift"], r["same"]]),
        ("diff", ["diff", r["same"], r["same"]]),
        ("diff", ["diff", r["a"], r["b"]]),
        ("bisect steps", ["bisect", "steps", r["drift"], "--no-save"]),
        ("bisect steps", ["bisect", "steps", r["same"], "--no-save"]),
        ("bisect layers", ["bisect", "layers", "--between", f"run:{r['a']},run:{r['b']}", "--no-save"]),
        ("bisect layers", ["bisect", "layers", "--between", f"run:{r['a']},run:{r['b']}", "--step", 3, "--no-save"]),
        ("bisect config", ["bisect", "config", r["a"], "--rank", 0, "--step", 3, "--no-save"]),
    ]


def test_the_first_line_is_the_verdict(recs):
    """verify, seal, report (and --against), diff, bisect steps, layers and config."""
    bad = []
    for kind, args in _commands(recs):
        line, code = first_line(*args)
        if not re.search(VERDICTS[kind], line):
            bad.append(f"replay {' '.join(map(str, args))} (exit {code}): {line!r}")
        if kind == "diff" and code != (0 if line.startswith("the same") else 1):
            bad.append(f"replay {' '.join(map(str, args))}: exit {code} does not match its verdict {line!r}")
    assert not bad, "\n".join(bad)


# A verdict says what was found: a divergence, agreement, a reproduction, a difference.
_VERDICT_WORDS = re.compile(r"diverge|disagree|agree|reproduc|bit for bit|bitwise|differ|the same|nothing to compare|raised")


def test_the_first_line_of_info_and_step_is_the_verdict(recs):
    bad = []
    for args in (["info", recs["drift"]], ["info", recs["same"]], ["step", recs["a"], "--rank", 0, "--step", 3, "--no-save"]):
        line, code = first_line(*args)
        if not _VERDICT_WORDS.search(line):
            bad.append(f"replay {' '.join(map(str, args))}: {line!r}")
    assert not bad, "\n".join(bad)
