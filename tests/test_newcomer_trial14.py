"""Found in the twenty-second session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json

import pytest

from tests.test_newcomer_scripts import _record, _replay, _script

pytestmark = pytest.mark.e2e


# A model one of whose layers the loop wraps in an adapter at its fifth call (replay's step 3:
# the first call is the prefill, found with no flags and not recorded).
_ADAPTER_MID_RUN = """
    import torch, torch.nn as nn

    class LoRA(nn.Module):
        def __init__(self, base, r=2):
            super().__init__()
            self.base = base
            g = torch.Generator().manual_seed(5)
            self.A = nn.Parameter(torch.randn(r, base.in_features, generator=g) * 0.1)
            self.B = nn.Parameter(torch.randn(base.out_features, r, generator=g) * 0.1)
        def forward(self, x):
            return self.base(x) + x @ self.A.t() @ self.B.t()

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.l1 = nn.Linear(16, 16)
            self.l2 = nn.Linear(16, 16)
            self.head = nn.Linear(16, 40)
        def forward(self, ids):
            return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids).mean(1))))))

    torch.manual_seed(0)
    m = LM()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for i in range(8):
            if i == 4:
                m.l2 = LoRA(m.l2)
            nxt = m(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    print("tokens", ids.tolist())
"""


def test_a_model_whose_parameters_changed_while_recorded_is_named_and_no_keyframe_is_offered(tmp_path) -> None:
    """A loop that wrapped a layer of its model in an adapter mid-run: a re-run builds the model
    as at its first recorded step, so steps after the change did not reproduce, and `replay step`
    told the user to record with --keyframe-every 1, which restores nothing of the kind. `info`
    now names the change, and `step` says why no keyframe helps; steps before it still reproduce."""
    _script(tmp_path, "lora", _ADAPTER_MID_RUN)
    out, _ = _record(tmp_path, "lora")
    info = _replay("info", out, cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "changed its parameters after its first recorded step" in info.stdout, info.stdout
    assert "4 added (l2.A, l2.B, l2.base.weight, l2.base.bias), 2 removed (l2.weight, l2.bias)" in info.stdout, info.stdout
    after = _replay("step", out, "--step", "5", "--json", cwd=tmp_path)
    text = _replay("step", out, "--step", "5", cwd=tmp_path).stdout
    assert text.startswith("not reproduced"), text
    assert "changed its parameters after its first recorded step" in text.splitlines()[0], text
    assert "--keyframe-every 1" not in text, text
    result = json.loads(after.stdout)
    assert result["headline"].startswith("not reproduced") and "l2.A" in (result.get("parameters_changed") or ""), result
    before = _replay("step", out, "--step", "1", cwd=tmp_path)
    assert before.returncode == 0 and before.stdout.startswith("reproduced"), before.stdout + before.stderr
