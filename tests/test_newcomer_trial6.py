"""Found by the seventeenth session's newcomer trial, each a test that failed before its fix.
Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _replay, _script

pytestmark = pytest.mark.e2e


def test_an_engine_built_after_the_first_is_re_run_in_its_own_engine(tmp_path: Path) -> None:
    """A script that decodes with one model, then builds a second (another seed) and decodes with
    it: two parts of one process. The re-launched program took the re-run of the second part
    over at the first model's first call: "not reproduced ... the step ran with other weights"."""
    _script(tmp_path, "twice", """
        import torch

        class LM(torch.nn.Module):
            def __init__(self, seed):
                super().__init__()
                torch.manual_seed(seed)
                self.emb = torch.nn.Embedding(64, 32)
                self.lin = torch.nn.Linear(32, 32)
                self.out = torch.nn.Linear(32, 64)

            def forward(self, tok, h):
                h = torch.tanh(self.lin(self.emb(tok)) + h)
                return self.out(h), h

        def run(seed, steps):
            m, tok, h = LM(seed), torch.tensor([1, 2]), torch.zeros(2, 32)
            with torch.no_grad():
                for _ in range(steps):
                    logits, h = m(tok, h)
                    tok = logits.argmax(-1)
            return tok.tolist()

        print(run(0, 6), run(1, 5))
    """)
    rec = tmp_path / "rec-twice"
    p = _replay("record", "--out", rec, "--", sys.executable, "twice.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for part, step in (("run-001", 3), ("run-000", 2), ("run-001", 0)):
        res = _replay("step", rec, "--part", part, "--step", step, "--json", "--no-save", cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        out = json.loads(res.stdout)
        assert out["weights"]["same"] is True, (part, out["weights"], out["headline"])
        verdicts = {(v["output"], v["verdict"]) for v in out["verdicts"]}
        assert verdicts == {("out0", "bitwise equal"), ("out1", "bitwise equal")}, (part, out["headline"])
