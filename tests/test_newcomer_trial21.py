"""Findings of the twenty-first newcomer trial (engines the tool was not written for): each test
fails on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An engine module holding the language model as ``self.lm``: recorded with ``--modules lm`` (bisect's
# hooks on the model's modules), the recorder digests the engine's parameters (``lm.emb.weight``).
_ENGINE = textwrap.dedent("""
    import torch, torch.nn as nn
    torch.set_num_threads(1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16); self.mlp = nn.Linear(16, 16); self.head = nn.Linear(16, 32)

        def forward(self, ids):
            return self.head(torch.tanh(self.mlp(self.emb(ids).mean(1))))

    class Engine(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids)

    def build(config=None, *, rank=0, world_size=1, device="cpu", options=None):
        torch.manual_seed(0)
        return Engine(LM().eval())

    if __name__ == "__main__":
        e = build()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(5):
                t = e(ids).argmax(-1, keepdim=True)
                ids = torch.cat([ids, t], 1)
        print(ids.tolist())
""")


def _env(cwd: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(cwd)])
    return env


def _replay(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env=_env(cwd), capture_output=True, text=True,
                          timeout=180)


@pytest.mark.e2e
def test_modules_naming_a_submodule_does_not_make_the_weights_differ(tmp_path):
    (tmp_path / "wrapped_engine.py").write_text(_ENGINE)
    rec = _replay("record", "--quiet", "--out", "rec", "--step", "wrapped_engine:Engine", "--factory", "wrapped_engine:build",
                  "--modules", "lm", "--", sys.executable, "wrapped_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    r = _replay("step", "rec", "--step", "2", "--no-save", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    w = d.get("weights") or {}
    # Before: "24 are not in the rebuilt model (lm.emb.weight, ...); 24 were not recorded (emb.weight, ...)".
    assert w.get("checked") and not w.get("differ") and not w.get("missing") and not w.get("extra"), w
    assert d["headline"].startswith("reproduced"), d["headline"]


@pytest.mark.e2e
def test_info_of_one_rank_says_nothing_was_compared_once(tmp_path):
    (tmp_path / "wrapped_engine.py").write_text(_ENGINE)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "wrapped_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    r = _replay("info", "rec", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("one rank: nothing to compare across ranks"), r.stdout
    assert r.stdout.count("nothing to compare across ranks") == 1, r.stdout
