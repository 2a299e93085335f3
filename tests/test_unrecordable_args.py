"""A step argument or output whose values are not a dense array of bytes (a sparse adjacency
matrix, a nested batch, a quantized tensor) is recorded by its kind only, and recording goes on:
before, the first such step stopped the recording ("nbytes is not defined for sparse tensors",
"SymIntArrayRef expected to contain only concrete integers") and nothing of the run was kept. A
re-run says what it did not compare.
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


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _replay(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(cwd, sys.executable, "-m", "replay", *args)


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
    plain = _run(tmp_path, sys.executable, "graph.py")
    rec = _replay(tmp_path, "record", "--out", "rec", "--", sys.executable, "graph.py")
    assert rec.returncode == 0, rec.stderr[-3000:]
    assert rec.stdout == plain.stdout  # the program computed what it computes unrecorded
    assert "recording stopped" not in rec.stderr, rec.stderr[-3000:]
    assert "takes adj (a sparse_coo tensor), recorded by class name only" in rec.stderr, rec.stderr[-3000:]
    info = _replay(tmp_path, "info", "rec", "--json")
    assert info.returncode == 0, info.stderr
    rank = json.loads(info.stdout)["ranks"][0]
    assert rank["steps"] >= 4 and rank["complete"], rank
    step = _replay(tmp_path, "step", "rec", "--step", "3", "--json")
    assert step.returncode == 0, step.stdout[-3000:] + step.stderr[-3000:]
    result = json.loads(step.stdout)
    assert [(v["output"], v["verdict"]) for v in result["verdicts"]] == [("logits", "bitwise equal")], result["verdicts"]
    assert result["unrecorded_arguments"] == ["adj (a sparse_coo tensor)"], result


def test_an_output_without_plain_bytes_is_named_in_the_step_and_the_rest_recorded(tmp_path: Path, capsys) -> None:
    from replay import Recorder, RecorderConfig, open_recording
    from replay.format.schema import TensorKind

    rec = Recorder(RecorderConfig(out=tmp_path / "r", rng=False))
    for s in range(3):
        rec.begin_step()
        logits = torch.full((2, 8), float(s))
        parts = torch.nested.nested_tensor([logits[0, :2], logits[1, :3]], layout=torch.jagged)
        rec.record_outputs(logits=logits, parts=parts, adj=_sparse())
        rec.end_step()
    rec.close()
    assert rec.error is None
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert rf.n_steps == 3
    for s in range(3):
        view = rf.step(s)
        assert set(view.digests(TensorKind.OUTPUT)) == {"logits"}
        sid = int(view.row["args"])
        assert json.loads(rf.tables.string(sid))["__unrecorded__"] == {"outputs.parts": "nested tensor", "outputs.adj": "sparse_coo tensor"}
    err = capsys.readouterr().err
    assert err.count("outputs.parts is a nested tensor: not recorded") == 1 and "recording stopped" not in err, err
    # `replay info` names them too: no verdict of this recording compares them.
    from replay import api
    from replay.cli.info_text import render_info

    summary = api.info(open_recording(tmp_path / "r"))
    assert summary.summary["unrecorded_fields"] == {"outputs.adj": "sparse_coo tensor", "outputs.parts": "nested tensor"}
    assert "not recorded  outputs.adj (a sparse_coo tensor), outputs.parts (a nested tensor)" in render_info(summary)


NESTED_OUTPUT = textwrap.dedent("""
    import torch

    torch.manual_seed(0)


    class Splitter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "parts": torch.nested.nested_tensor([y[0, :2], y[1, :3]], layout=torch.jagged)}


    m = Splitter()
    with torch.no_grad():
        for step in range(5):
            print(step, float(m(torch.randn(2, 8))["logits"].sum()))
""")


@pytest.mark.e2e
def test_a_nested_output_is_named_as_not_compared_and_the_logits_rerun(tmp_path: Path) -> None:
    (tmp_path / "split.py").write_text(NESTED_OUTPUT)
    rec = _replay(tmp_path, "record", "--out", "rec", "--", sys.executable, "split.py")
    assert rec.returncode == 0 and "recording stopped" not in rec.stderr, rec.stderr[-3000:]
    assert rec.stderr.count("outputs.parts is a nested tensor: not recorded") == 1, rec.stderr[-3000:]
    step = _replay(tmp_path, "step", "rec", "--step", "2", "--json")
    assert step.returncode == 0, step.stdout[-3000:] + step.stderr[-3000:]
    result = json.loads(step.stdout)
    assert [(v["output"], v["verdict"]) for v in result["verdicts"]] == [("logits", "bitwise equal")], result["verdicts"]
    assert any(n.startswith("not compared: outputs.parts (a nested tensor)") for n in result["notes"]), result["notes"]


def test_numbers_and_strings_beside_tensors_in_a_container_are_kept_and_rebuilt() -> None:
    from replay.core.structure import STRUCTURE_ARG, rebuild_inputs

    def step(batch, plain):
        pass

    batch = {"input_ids": torch.arange(4), "request_ids": ["a", "b"], "temperature": 0.7, "greedy": True, "mask": None}
    tensors, scalars = _split(step, batch, [torch.ones(2), torch.zeros(2)])
    assert set(tensors) == {"batch.input_ids", "plain.0", "plain.1"}
    assert "batch" not in scalars and "plain" not in scalars[STRUCTURE_ARG]  # a list of tensors stays plain
    back = rebuild_inputs(tensors, json.loads(json.dumps(scalars[STRUCTURE_ARG])))
    assert back["batch"].keys() == batch.keys()
    assert torch.equal(back["batch"]["input_ids"], batch["input_ids"])
    assert {k: v for k, v in back["batch"].items() if k != "input_ids"} == {k: v for k, v in batch.items() if k != "input_ids"}
    _, nan = _split(step, {"x": torch.ones(1), "t": float("nan")}, None)
    assert nan["batch"] == {"unrecorded": "dict", "object": nan["batch"]["object"]}  # NaN is not kept as a value
