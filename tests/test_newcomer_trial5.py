"""Found by the sixteenth session's newcomer trial, each a test that failed before its fix.
Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _replay, _script

pytestmark = pytest.mark.e2e


def test_a_dynamically_quantized_model_is_the_step_not_the_quantizers_observer(tmp_path: Path) -> None:
    """``quantize_dynamic`` runs a MinMaxObserver (an nn.Module) once while it converts the model,
    before the loop: with no flags it was taken for the step (one call recorded, the model's six
    calls named as "also called ... not recorded")."""
    _script(tmp_path, "qdyn", """
        import warnings
        warnings.filterwarnings("ignore")
        import torch
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 100))
        q = torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
        h = torch.randn(2, 32)
        with torch.inference_mode():
            for i in range(6):
                logits = q(h)
                h = h.roll(1, -1) + 0.01 * logits[:, :32]
                print(i, logits.argmax(-1).tolist())
    """)
    rec = tmp_path / "rec-qdyn"
    p = _replay("record", "--out", rec, "--", sys.executable, "qdyn.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step found with no flags: torch.nn.modules.container:Sequential" in p.stderr, p.stderr[-3000:]
    assert "Observer" not in p.stderr, p.stderr[-3000:]
    res = _replay("step", rec, "--step", 3, "--json", "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    vs = json.loads(res.stdout)["modes"]["eager"]["vs_recording"]
    assert list(vs) == ["logits"] and vs["logits"]["verdict"] == "bitwise equal", vs
