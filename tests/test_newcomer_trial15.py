"""Found in the twenty-third session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _replay, _script

pytestmark = pytest.mark.e2e

# A model whose output depends on a Python attribute read inside forward (a scale, a
# temperature, a flag), set from the command line; it has no config object.
_ATTRIBUTE_IN_FORWARD = """
    import sys
    import torch, torch.nn as nn

    class Model(nn.Module):
        def __init__(s, scale):
            super().__init__()
            s.emb = nn.Embedding(50, 16)
            s.fc = nn.Linear(16, 16)
            s.head = nn.Linear(16, 50)
            s.scale = scale
        def forward(s, ids):
            return s.head(torch.tanh(s.fc(s.emb(ids))) * s.scale)[:, -1]

    torch.manual_seed(0)
    model = Model(float(sys.argv[1])).eval()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
"""


def test_diff_names_a_python_attribute_of_the_model_that_differs(tmp_path: Path) -> None:
    """Two runs whose model differs only in a Python attribute read inside forward: diff said
    "config the same" (an empty config compared with an empty config) and named nothing else
    but the command line. It names the attribute, as the keyframes hold it."""
    _script(tmp_path, "attr", _ATTRIBUTE_IN_FORWARD)
    recs = []
    for scale in ("1.0", "1.001"):
        out = tmp_path / f"rec-{scale}"
        p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "attr.py", scale, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        recs.append(out)
    d = _replay("diff", *recs, cwd=tmp_path)
    assert d.returncode == 1
    config = next(line for line in d.stdout.splitlines() if line.strip().startswith("config"))
    assert "1 differ: target.scale: A 1.0, B 1.001" in config, d.stdout
    same = json.loads(_replay("diff", recs[0], recs[0], "--json", cwd=tmp_path).stdout)
    config = next(c for c in same["other_differences"] if c["category"] == "config")
    assert config["compared"] and not config["differs"], config


# Three requests decoded by concurrent tasks on one event loop, each awaiting the async step.
_CONCURRENT_ASYNC_STEPS = """
    import asyncio
    import torch, torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)).eval()

    async def step(ids):
        await asyncio.sleep(0)
        with torch.no_grad():
            logits = model(ids)[:, -1]
        await asyncio.sleep(0.001)
        return logits.argmax(-1, keepdim=True)

    async def request(first):
        ids = torch.tensor([[first]])
        for _ in range(5):
            ids = torch.cat([ids, await step(ids)], 1)

    async def main():
        await asyncio.gather(request(1), request(2), request(3))

    asyncio.run(main())
"""


def test_calls_of_an_async_step_not_recorded_while_another_is_awaited_are_said(tmp_path: Path) -> None:
    """15 calls of an async step from three concurrent tasks: 5 were recorded (one at a time),
    and neither ``replay record`` nor ``info`` said that 10 were not."""
    _script(tmp_path, "aio", _CONCURRENT_ASYNC_STEPS)
    out = tmp_path / "rec"
    p = _replay("record", "--out", out, "--step", "aio:step", "--", sys.executable, "aio.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "aio:step: 10 call(s) not recorded: each began while another call of it was being awaited" in p.stderr, p.stderr
    info = _replay("info", out, cwd=tmp_path)
    assert "5 " in info.stdout and "calls not recorded: 10 call(s) of aio:step on rank 0" in info.stdout, info.stdout
