"""Bugs found by the seventh newcomer trial (issue 15's session 17), each a test that failed
before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _record, _replay, _script

pytestmark = pytest.mark.e2e

# The loop changes the model's state between steps, outside the step: only a keyframe at each
# step holds that; catch-up from an earlier keyframe cannot.
_HALVE = """
    import torch
    torch.manual_seed(0)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)
            self.register_buffer("memory", torch.ones(8))
        def forward(self, x):
            return self.lin(x * self.memory)
    model = Decoder().eval()
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(6):
            logits = model(x)
            x = logits[:, :8].tanh()
            model.memory.mul_(0.5)
"""


def test_bisect_against_rerun_restores_each_keyframe_it_reaches_as_replay_step_does(tmp_path: Path) -> None:
    """Recorded with ``--keyframe-every 1``: ``replay step`` reproduces every step from its own
    keyframe, so ``bisect steps --against-rerun`` finds no departure (before: its one launch
    caught up from step 0 and said "first departs at step 1", a step ``replay step`` reproduced)."""
    _script(tmp_path, "halve", _HALVE)
    rec, _ = _record(tmp_path, "halve", "--keyframe-every", "1")
    one = _replay("step", rec, "--step", 2, "--no-save", cwd=tmp_path)
    assert one.returncode == 0 and one.stdout.startswith("reproduced"), one.stdout + one.stderr[-2000:]
    b = _replay("bisect", "steps", "--against-rerun", rec, "--no-save", "--json", cwd=tmp_path)
    assert b.returncode == 0, b.stdout + b.stderr[-2000:]
    found = json.loads(b.stdout)
    assert found["first"] is None, found
    assert any(n.startswith("restored the keyframes at steps 1, 2, 3") for n in found["notes"]), found["notes"]


# One step of the loop runs with a buffer the loop sets around it and puts back: the re-run's
# catch-up (which drives the step alone) departs there, and the steps after it match again.
_ONCE = """
    import torch
    torch.manual_seed(0)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)
            self.register_buffer("memory", torch.ones(8))
        def forward(self, x):
            return self.lin(x * self.memory)
    model = Decoder().eval()
    with torch.no_grad():
        for i in range(6):
            if i == 2:
                model.memory.fill_(0.5)
            logits = model(torch.randn(1, 8))
            if i == 2:
                model.memory.fill_(1.0)
"""


def test_a_step_that_matches_after_a_catch_up_departure_says_so_in_its_verdict_line(tmp_path: Path) -> None:
    """``replay step 3`` catches up over steps 0..2 and step 1 departs; step 3 itself matches.
    The verdict line says both (before: a bare "reproduced ... bit for bit", the departure only
    further down)."""
    _script(tmp_path, "once", _ONCE)
    rec, _ = _record(tmp_path, "once")
    one = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    head = one.stdout.splitlines()[0]
    assert head.startswith("reproduced"), one.stdout + one.stderr[-2000:]
    assert "but catch-up step 1 (output.logits) departed from the recording in eager" in head, head
