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


_SAMPLER = """
    import torch
    torch.manual_seed(0)

    class Sampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 20)

        def forward(self, h):
            return RETURNED

    m = Sampler()
    h = torch.randn(3, 8)
    with torch.no_grad():
        for i in range(6):
            toks = m(h)
            h = h + torch.tensor([float(str(t).strip("<>")) for t in toks])[:, None] * 0.01
            print(i, toks)
"""


def test_a_step_that_returns_python_ints_is_recorded_and_compared(tmp_path: Path) -> None:
    """A sampler returning ``.tolist()``: nothing it returns is a tensor. The recording said
    nothing about it, and ``replay step`` said the re-run "returned nothing"; since the
    twenty-third session the numbers are an output, recorded and compared."""
    _script(tmp_path, "listout", _SAMPLER.replace("RETURNED", "self.lin(h).argmax(-1).tolist()"))
    rec = tmp_path / "rec-listout"
    p = _replay("record", "--out", rec, "--", sys.executable, "listout.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "returns a list with no tensor in it" not in p.stderr, p.stderr[-3000:]
    res = _replay("step", rec, "--step", 3, "--no-save", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    vs = json.loads(res.stdout)["modes"]["eager"]["vs_recording"]
    assert vs and all(c["verdict"] == "bitwise equal" for c in vs.values()), vs


def test_a_step_that_returns_python_strings_is_said_to_record_nothing_comparable(tmp_path: Path) -> None:
    """A sampler returning its tokens as text: nothing it returns is a tensor or a number. Said
    once when recorded; ``replay step`` says nothing could be compared (exit 7)."""
    _script(tmp_path, "strout", _SAMPLER.replace("RETURNED", '[f"<{t}>" for t in self.lin(h).argmax(-1).tolist()]'))
    rec = tmp_path / "rec-strout"
    p = _replay("record", "--out", rec, "--", sys.executable, "strout.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("strout:Sampler returns a list with no tensor in it: its results are not recorded") == 1, p.stderr[-3000:]
    res = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    assert res.returncode == 7, res.stdout[-2000:] + res.stderr[-2000:]
    said = res.stdout + res.stderr
    assert "no output of step 3 could be compared with the recording (the step returned no tensor" in said, said[-3000:]
    assert "bitwise equal" not in said, said[-3000:]


def test_a_batch_dict_with_request_ids_and_a_temperature_is_recorded_whole(tmp_path: Path) -> None:
    """``forward(batch)`` with ``{"input_ids": t, "request_ids": ["a", "b"], "temperature": 0.7}``:
    the strings and the number made the dict "not a tensor container", so it was recorded by class
    name only: its token ids were not recorded, and a re-run had to run the program up to the step."""
    _script(tmp_path, "dictbatch", """
        import torch
        torch.manual_seed(0)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(50, 16)
                self.out = torch.nn.Linear(16, 50)

            def forward(self, batch):
                return self.out(self.emb(batch["input_ids"]).mean(1) * batch["temperature"])

        m = M()
        ids = torch.tensor([[1, 2], [3, 4]])
        with torch.no_grad():
            for i in range(6):
                logits = m({"input_ids": ids, "request_ids": ["a", "b"], "temperature": 0.7})
                ids = torch.cat([ids[:, 1:], logits.argmax(-1, keepdim=True)], 1)
                print(i, ids[:, -1].tolist())
    """)
    rec = tmp_path / "rec-dictbatch"
    p = _replay("record", "--out", rec, "--", sys.executable, "dictbatch.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "recorded by class name only" not in p.stderr, p.stderr[-3000:]
    from replay.format.reader import Recording

    with Recording(rec) as r:
        view = r["run-000"][0].step(3)
        assert sorted(view.inputs) == ["batch.input_ids"], sorted(view.inputs)
    res = _replay("step", rec, "--step", 3, "--json", "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["modes"]["eager"]["vs_recording"]["logits"]["verdict"] == "bitwise equal", out["modes"]
    assert not any("program's own" in n for n in out["notes"]), out["notes"]


def test_each_multiprocessing_worker_is_re_run_in_its_own_process(tmp_path: Path) -> None:
    """Two ``multiprocessing`` spawn workers, each its own model (seeded by its number), record as
    two parts. The re-launched program's first worker to call the step took the re-run over,
    whichever part was asked for: "different ... ran with other weights than the re-run's"."""
    _script(tmp_path, "workers", """
        import torch
        import torch.multiprocessing as mp

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x)

        def worker(n):
            torch.manual_seed(n)
            m, x = M(), torch.randn(2, 8)
            with torch.no_grad():
                for i in range(5):
                    x = torch.tanh(m(x))
            print(n, float(x.sum()))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            ps = [ctx.Process(target=worker, args=(n,)) for n in range(2)]
            [p.start() for p in ps]
            [p.join() for p in ps]
    """)
    rec = tmp_path / "rec-workers"
    p = _replay("record", "--out", rec, "--", sys.executable, "workers.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for part in ("run-001", "run-000", "run-001"):
        res = _replay("step", rec, "--part", part, "--step", 2, "--json", "--no-save", cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        out = json.loads(res.stdout)
        assert out["weights"]["same"] is True, (part, out["weights"], out["headline"])
        assert [(v["output"], v["verdict"]) for v in out["verdicts"]] == [("logits", "bitwise equal")], (part, out["headline"])
