"""Decode loops in styles the first trial did not try, taken through the README's workflow
(issue 15's session 9 trial: each test is one bug found there). Nothing in the scripts was
adapted to replay.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import RERUN_ERROR, _plain, _record, _replay, _script

pytestmark = pytest.mark.e2e

USAGE_ERROR = 2


@pytest.mark.smoke
def test_a_step_that_writes_into_an_out_buffer_records_and_compares_it(tmp_path: Path) -> None:
    """``m(ids, out)`` returns None: what it wrote into ``out`` is its output, recorded after the
    call and compared by the re-run (before, nothing the step computed was recorded)."""
    _script(tmp_path, "outbuf", """
        import torch, torch.nn as nn
        torch.manual_seed(0)

        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32, bias=False)
            def forward(self, ids, out):
                torch.matmul(self.emb(ids), self.head.weight.T, out=out)

        m = M(); ids = torch.tensor([1, 2]); buf = torch.empty(2, 32)
        with torch.no_grad():
            for _ in range(5):
                m(ids, buf); ids = buf.argmax(-1)
        print(ids.tolist())
    """)
    rec, _ = _record(tmp_path, "outbuf")
    info = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert info["ranks"][0]["steps"] >= 4  # found with no flags: the first call is running when it is chosen
    p = _replay("step", rec, "--rank", 0, "--step", 3, "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced"), p.stdout
    assert any(row.split()[:2] == ["eager", "out"] and "bitwise equal" in row for row in p.stdout.splitlines()), p.stdout


def test_ranks_that_recorded_only_inputs_are_not_called_the_same(tmp_path: Path) -> None:
    """Two gloo ranks whose step returns a Python list of strings (decoded text; a list of
    numbers is recorded as an output since the twenty-third session): the inputs agree, nothing
    computed was recorded. Never "no divergence"; ``bisect steps`` exits non-zero."""
    _script(tmp_path, "twolist", """
        import os, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp

        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.head = nn.Linear(8, 16)
            def forward(self, x):
                return [f"<{t}>" for t in self.head(x).argmax(-1).tolist()]

        def run(rank, store):
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
            torch.manual_seed(0); m = M()
            if rank == 1:
                with torch.no_grad(): m.head.weight[0, 0] += 1.0
            x = torch.ones(2, 8)
            with torch.no_grad():
                for _ in range(3):
                    m(x)
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(run, args=(os.path.abspath("store"),), nprocs=2)
    """)
    rec, _ = _record(tmp_path, "twolist")
    p = _replay("info", rec, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = p.stdout.splitlines()[0]
    assert first.startswith("nothing compared"), p.stdout
    assert "no divergence" not in p.stdout
    b = _replay("bisect", "steps", rec, cwd=tmp_path)
    assert b.returncode == RERUN_ERROR, b.stdout + b.stderr
    assert "agree at every common step" not in b.stdout


def test_a_forward_whose_first_parameter_is_not_self_is_re_run(tmp_path: Path) -> None:
    """``def forward(s, ids)``, found with no flags: ``s`` is the module, not an argument."""
    _script(tmp_path, "notself", """
        import torch, torch.nn as nn
        torch.manual_seed(1)

        class M(nn.Module):
            def __init__(s):
                super().__init__(); s.emb = nn.Embedding(32, 16); s.head = nn.Linear(16, 32)
            def forward(s, ids):
                return s.head(s.emb(ids))

        m = M(); ids = torch.tensor([3, 4])
        with torch.no_grad():
            for _ in range(4):
                ids = m(ids).argmax(-1)
    """)
    rec, _ = _record(tmp_path, "notself")
    p = _replay("step", rec, "--rank", 0, "--step", 2, "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced"), p.stdout


def test_a_step_called_from_a_worker_thread_is_re_run(tmp_path: Path) -> None:
    """The decode loop runs in a ``threading.Thread``: the re-launched program's step is found there."""
    _script(tmp_path, "threaded", """
        import threading, torch, torch.nn as nn
        torch.manual_seed(2)

        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32)
            def forward(self, ids):
                return self.head(self.emb(ids))

        def decode(m):
            ids = torch.tensor([5, 6])
            with torch.no_grad():
                for _ in range(4):
                    ids = m(ids).argmax(-1)

        t = threading.Thread(target=decode, args=(M(),)); t.start(); t.join()
    """)
    rec, _ = _record(tmp_path, "threaded")
    p = _replay("step", rec, "--rank", 0, "--step", 2, "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced"), p.stdout


def test_a_generator_argument_is_restored_and_the_rank_is_optional(tmp_path: Path) -> None:
    """``m(ids, generator=g)`` samples from the program's own generator: its state is recorded
    with each step and set back, so a sampled step reproduces; a one-rank recording needs no --rank."""
    _script(tmp_path, "sampler", """
        import torch, torch.nn as nn
        torch.manual_seed(3)

        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(64, 16); self.head = nn.Linear(16, 64)
            def forward(self, ids, generator=None):
                probs = self.head(self.emb(ids)).softmax(-1)
                return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

        m = M(); g = torch.Generator().manual_seed(7); ids = torch.tensor([1, 2, 3])
        with torch.no_grad():
            for _ in range(6):
                ids = m(ids, g)
        print(ids.tolist())
    """)
    rec, _ = _record(tmp_path, "sampler")
    assert _plain(tmp_path, "sampler").stdout.strip()  # the program runs alone too
    for step in (0, 4):
        p = _replay("step", rec, "--step", step, "--no-save", cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr[-2000:]
        assert p.stdout.startswith("reproduced"), p.stdout


def test_cudagraph_mode_on_a_cpu_is_refused_before_the_program_is_re_launched(tmp_path: Path) -> None:
    _script(tmp_path, "plainloop", """
        import torch, torch.nn as nn
        torch.manual_seed(4)
        m = nn.Linear(8, 8); x = torch.ones(1, 8)
        with torch.no_grad():
            for _ in range(3):
                x = m(x)
    """)
    rec, _ = _record(tmp_path, "plainloop")
    t0 = time.perf_counter()
    p = _replay("step", rec, "--step", 1, "--mode", "both", "--device", "cpu", "--no-save", cwd=tmp_path)
    assert p.returncode == USAGE_ERROR, p.stdout + p.stderr
    assert "re-launching" not in p.stderr
    assert "--mode eager" in p.stderr and "Traceback" not in p.stderr
    assert time.perf_counter() - t0 < 60


def test_diff_names_a_differing_buffer(tmp_path: Path) -> None:
    """An int8 quantised weight lives in a buffer: ``diff`` lists it, not "weights the same" alone."""
    _script(tmp_path, "quant", """
        import sys, torch, torch.nn as nn
        torch.manual_seed(5)

        class Q(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("wq", torch.randint(-100, 100, (16, 8), dtype=torch.int8))
                self.scale = nn.Parameter(torch.full((16, 1), 0.01))
            def forward(self, x):
                return x @ (self.wq.float() * self.scale).T

        m = Q()
        if "--perturb" in sys.argv:
            m.wq[3, 2] += 1
        x = torch.ones(2, 8)
        with torch.no_grad():
            for _ in range(3):
                m(x)
    """)
    a, _ = _record(tmp_path, "quant")
    out_b = tmp_path / "rec-quant-b"
    p = _replay("record", "--quiet", "--out", out_b, "--", sys.executable, "quant.py", "--perturb", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    d = _replay("diff", a, out_b, cwd=tmp_path)
    line = next(x for x in d.stdout.splitlines() if x.strip().startswith("buffers"))
    assert "1 differ" in line and "wq" in line, d.stdout


@pytest.mark.gpu
def test_on_cuda_an_out_buffer_and_a_generator_argument_are_recorded_and_reproduced(tmp_path: Path) -> None:
    """The CUDA step path (its early snapshot of tensor arguments) with a step that samples from
    a CUDA generator it is given and writes its logits into an ``out=`` buffer."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _script(tmp_path, "cudasample", """
        import torch, torch.nn as nn
        torch.manual_seed(6)

        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(64, 32); self.head = nn.Linear(32, 64)
            def forward(self, ids, logits, generator):
                torch.matmul(self.emb(ids), self.head.weight.T, out=logits)
                ids.copy_(torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1))

        m = M().cuda(); g = torch.Generator(device="cuda").manual_seed(9)
        ids = torch.tensor([1, 2, 3], device="cuda"); logits = torch.empty(3, 64, device="cuda")
        with torch.no_grad():
            for _ in range(6):
                m(ids, logits, g)
        print(ids.tolist())
    """)
    rec, _ = _record(tmp_path, "cudasample")
    for step in (1, 4):
        p = _replay("step", rec, "--step", step, "--mode", "eager", "--no-save", cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr[-2000:]
        assert p.stdout.startswith("reproduced"), p.stdout
        assert any(row.split()[:2] == ["eager", "logits"] and "bitwise equal" in row for row in p.stdout.splitlines()), p.stdout
