"""Bugs left from the first two trials and found by the third (issue 15's session 10), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import RERUN_ERROR, _record, _replay, _script

pytestmark = pytest.mark.e2e


def test_bisect_against_the_rerun_names_a_catch_up_step_that_raises_anew(tmp_path: Path) -> None:
    """The engine now raises at step 3 (here: a file it reads appeared since the recording). A
    bisection without a factory scans steps 0..5 in one launch; step 3 is a catch-up step there.
    It is the answer ("first departs at step 3"), not an error that ends the bisection."""
    _script(tmp_path, "drifting", """
        import os, torch, torch.nn as nn
        torch.manual_seed(0)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(40, 16); self.head = nn.Linear(16, 40)
            def forward(self, ids, pos):
                if pos == 3 and os.path.exists("broken"):
                    raise RuntimeError("a config the engine reads now breaks step 3")
                return self.head(self.emb(ids).mean(1))

        m = M().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for pos in range(6):
                tok = m(ids, pos).argmax(-1, keepdim=True)
                ids = torch.cat([ids[:, 1:], tok], 1)
        print("done", ids.tolist())
    """)
    rec, _ = _record(tmp_path, "drifting", "--step", "drifting:M.forward")
    clean = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--json", "--no-save", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["first"] is None
    (tmp_path / "broken").write_text("")
    res = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--json", "--no-save", cwd=tmp_path)
    assert res.returncode != RERUN_ERROR, res.stderr
    data = json.loads(res.stdout)
    assert (data["first"], data["field"]) == (3, "error"), data
    text = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--no-save", cwd=tmp_path).stdout
    assert "first departs from the recording at step 3 (it raised in the re-run" in text.splitlines()[0], text
