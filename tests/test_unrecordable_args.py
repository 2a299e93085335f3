"""A step argument whose values are not a dense array of bytes (a sparse adjacency matrix, a
nested batch, a quantized tensor) is recorded by its kind only, as an object is, and recording goes
on: before, the first such step stopped the recording ("nbytes is not defined for sparse
tensors") and nothing of the run was kept.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from replay.record.calls import split_arguments, unrecordable

ROOT = Path(__file__).resolve().parent.parent


def _split(fn, *args, **kwargs):
    return split_arguments(inspect.signature(fn).bind(*args, **kwargs), skip_first=False)


def _sparse() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.ones(3), (4, 4))


def test_each_kind_of_tensor_without_plain_bytes_is_named_and_the_rest_recorded() -> None:
    def step(x, adj, csr, ragged, q, meta, pair, d):
        pass

    ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
    tensors, scalars = _split(step, torch.ones(3), _sparse(), _sparse().to_sparse_csr(), ragged, q,
                              torch.empty(2, device="meta"), [torch.ones(1), _sparse()], {"a": torch.ones(2)})
    assert set(tensors) == {"x", "d.a"}
    assert scalars["adj"] == {"unrecorded": "sparse_coo tensor"}
    assert scalars["csr"] == {"unrecorded": "sparse_csr tensor"}
    assert scalars["ragged"] == {"unrecorded": "nested tensor"}
    assert scalars["q"] == {"unrecorded": "quantized tensor"}
    assert scalars["meta"] == {"unrecorded": "meta tensor"}
    assert scalars["pair"] == {"unrecorded": "list holding a sparse_coo tensor"}
    for t in (torch.ones(2, 3).t(), torch.ones(2, dtype=torch.bfloat16), torch.ones(2)[::2], torch.ones(2, dtype=torch.complex64).conj()):
        assert unrecordable(t) is None, t


PROGRAM = textwrap.dedent("""
    import torch

    torch.manual_seed(0)


    class GraphLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x, adj):
            return torch.sparse.mm(adj, self.lin(x))


    layer = GraphLayer()
    adj = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.ones(3), (4, 4))
    with torch.no_grad():
        for step in range(6):
            print(step, float(layer(torch.randn(4, 16), adj).sum()))
""")


@pytest.mark.e2e
def test_a_program_with_a_sparse_argument_is_recorded_and_its_step_reruns(tmp_path: Path) -> None:
    (tmp_path / "graph.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = "ignore"

    def replay(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "replay", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    plain = subprocess.run([sys.executable, "graph.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    rec = replay("record", "--out", "rec", "--", sys.executable, "graph.py")
    assert rec.returncode == 0, rec.stderr[-3000:]
    assert rec.stdout == plain.stdout  # the program computed what it computes unrecorded
    assert "recording stopped" not in rec.stderr, rec.stderr[-3000:]
    assert "takes adj (a sparse_coo tensor), recorded by class name only" in rec.stderr, rec.stderr[-3000:]
    info = replay("info", "rec", "--json")
    assert info.returncode == 0, info.stderr
    rank = json.loads(info.stdout)["ranks"][0]
    assert rank["steps"] >= 4 and rank["complete"], rank
    step = replay("step", "rec", "--step", "3", "--json")
    assert step.returncode == 0, step.stdout[-3000:] + step.stderr[-3000:]
    result = json.loads(step.stdout)
    assert [(v["output"], v["verdict"]) for v in result["verdicts"]] == [("logits", "bitwise equal")], result["verdicts"]
    assert result["unrecorded_arguments"] == ["adj (a sparse_coo tensor)"], result
