"""Small decode loops written the way a newcomer writes them, taken through `replay record` and
`replay step` as the README says (issue 15's session 8 trial: each test is one bug found there).

Each script is written into the test's directory and recorded with `replay record -- python3
script.py`; nothing in it was adapted to replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RERUN_ERROR = 7

pytestmark = pytest.mark.e2e


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _replay(*args: Any, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300)


def _script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


# The end of a two-rank script: ``worker(rank, port)`` on two gloo ranks started by mp.spawn.
_SPAWN_TWO_RANKS = """
    if __name__ == "__main__":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(worker, args=(port,), nprocs=2)
"""


def _record(tmp: Path, name: str, *flags: str) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp / f"rec-{name}"
    p = _replay("record", "--quiet", "--out", out, *flags, "--", sys.executable, f"{name}.py", cwd=tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    return out, p


def _plain(tmp: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"{name}.py"], cwd=tmp, env=_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.smoke
def test_a_step_that_raised_with_nothing_recorded_is_not_compared(tmp_path: Path) -> None:
    """The module raises on a data condition and the loop catches it: re-running that step
    raises as recorded, which compares nothing; never "bit for bit", never exit 0."""
    _script(tmp_path, "flaky", """
        import torch, torch.nn as nn
        torch.manual_seed(3)

        class Flaky(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(30, 16); self.head = nn.Linear(16, 30)
            def forward(self, ids):
                out = self.head(self.emb(ids).mean(1))
                if int(ids[0, -1]) == 7:
                    raise ValueError("token 7 seen")
                return out

        m = Flaky().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for feed in [4, 5, 7, 6, 7, 8]:
                try:
                    m(ids)
                except ValueError:
                    pass
                ids = torch.cat([ids[:, 1:], torch.tensor([[feed]])], 1)
    """)
    rec, _ = _record(tmp_path, "flaky", "--step", "flaky:Flaky.forward")
    res = _replay("step", rec, "--rank", 0, "--step", 3, "--no-save", cwd=tmp_path)
    first = res.stdout.splitlines()[0]
    assert res.returncode == RERUN_ERROR, res.stdout + res.stderr
    assert first.startswith("not compared: rank 0 step 3") and "raised ValueError" in first, first
    assert "bit for bit" not in first
    data = json.loads(_replay("step", rec, "--rank", 0, "--step", 3, "--no-save", "--json", cwd=tmp_path).stdout)
    assert data["problem"] and data["headline"].startswith("not compared")
    # The control: a step that completed reproduces (the test above can fail).
    ok = _replay("step", rec, "--rank", 0, "--step", 1, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr


def test_a_counter_the_module_keeps_is_set_back_for_a_step_found_with_no_flags(tmp_path: Path) -> None:
    """No flags: the step is found at a call that is not recorded, which moved the module's
    Python counter; a re-run inside the program must set it back to the recorded value even
    though the keyframe saw it before it changed again."""
    _script(tmp_path, "counted", """
        import torch, torch.nn as nn
        torch.manual_seed(3)

        class Counted(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(30, 16); self.head = nn.Linear(16, 30)
                self.step_index = 0
            def forward(self, ids):
                self.step_index += 1
                return self.head(self.emb(ids).mean(1)) + 0.01 * self.step_index

        m = Counted().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for i in range(6):
                t = m(ids).argmax(-1, keepdim=True)
                ids = torch.cat([ids[:, 1:], t], 1)
    """)
    rec, _ = _record(tmp_path, "counted")
    for step in (0, 3):
        res = _replay("step", rec, "--rank", 0, "--step", step, "--no-save", cwd=tmp_path)
        assert res.returncode == 0 and res.stdout.startswith(f"reproduced: rank 0 step {step}"), res.stdout + res.stderr
    if not torch.cuda.is_available():
        # Refused before the program is started again, not after.
        res = _replay("step", rec, "--rank", 0, "--step", 1, "--device", "cuda:0", "--no-save", cwd=tmp_path)
        assert res.returncode == 2 and "no CUDA device here" in res.stderr and "re-launching" not in res.stderr, res.stderr


def test_a_function_step_after_a_dataclass_is_recorded_from_its_first_call(tmp_path: Path) -> None:
    """A ``@dataclass`` runs generated code in the script's globals before ``def step``: the
    hook that patches ``step`` must still be waiting for it."""
    _script(tmp_path, "dc", """
        from dataclasses import dataclass
        import torch

        @dataclass
        class Unused:
            x: int = 0

        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        def step(x):
            return x @ w

        x = torch.ones(1, 4)
        for _ in range(5):
            x = step(x).tanh()
    """)
    rec, _ = _record(tmp_path, "dc", "--step", "dc:step")
    report = json.loads(next(rec.glob("session-*.json")).read_text())
    assert report["ran"] == {"dc:step": 5}
    info = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert info["ranks"][0]["steps"] == 5


def test_the_program_s_own_tracer_is_left_in_place(tmp_path: Path) -> None:
    """A program that installs ``sys.settrace`` (coverage, a debugger) before its step's ``def``
    keeps it: the recorder's hook removes only itself."""
    _script(tmp_path, "traced", """
        import sys, torch
        calls = []
        def tracer(frame, event, arg):
            if event == "call":
                calls.append(frame.f_code.co_name)
            return None
        sys.settrace(tracer)
        w = torch.eye(4)
        def step(x):
            return x @ w
        x = torch.ones(1, 4)
        for _ in range(3):
            x = step(x)
        print("kept", sys.gettrace() is tracer, "steps traced", calls.count("step"))
    """)
    plain = _plain(tmp_path, "traced")
    assert plain.stdout.strip() == "kept True steps traced 3"
    _, p = _record(tmp_path, "traced", "--step", "traced:step")
    assert p.stdout.strip() == plain.stdout.strip()


def test_json_output_is_only_json_when_the_step_s_module_prints(tmp_path: Path) -> None:
    """A function step of a script that prints, with no ``__main__`` guard: the re-run runs it in
    the re-launched program (importing it here ran its whole loop); stdout stays the verdict or
    the JSON."""
    _script(tmp_path, "loud", """
        import torch
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        def step(x):
            return {"logits": x @ w}
        x = torch.ones(1, 4)
        for _ in range(4):
            x = step(x)["logits"].tanh()
        print("the program's own output")
    """)
    rec, _ = _record(tmp_path, "loud", "--step", "loud:step")
    res = _replay("step", rec, "--rank", 0, "--step", 2, "--no-save", "--json", cwd=tmp_path)
    data = json.loads(res.stdout)
    assert data["headline"].startswith("reproduced"), data["headline"]
    assert "the program's own output" not in res.stdout
    text = _replay("step", rec, "--rank", 0, "--step", 2, "--no-save", cwd=tmp_path)
    assert text.stdout.startswith("reproduced: rank 0 step 2"), text.stdout


def test_cudagraph_mode_of_a_compiled_step_off_cuda_is_refused(tmp_path: Path) -> None:
    """torch.compile's reduce-overhead mode captures no CUDA graph on the CPU: a "cudagraph"
    re-run there is refused, not reported as reproduced under a graph."""
    _script(tmp_path, "compiled", """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        m = torch.compile(nn.Linear(8, 8), backend="eager")
        x = torch.ones(1, 8)
        with torch.no_grad():
            for _ in range(4):
                x = m(x).tanh()
    """)
    rec, _ = _record(tmp_path, "compiled")
    res = _replay("step", rec, "--rank", 0, "--step", 2, "--mode", "cudagraph", "--device", "cpu", "--no-save", cwd=tmp_path)
    assert res.returncode != 0 and "needs --device cuda" in res.stderr, res.stdout + res.stderr
    assert "bit for bit" not in res.stdout


def test_a_private_generator_the_model_samples_with_is_restored(tmp_path: Path) -> None:
    """Sampling from a ``torch.Generator`` the module keeps (not the default one): the keyframe
    holds its state, and a re-run of a later step draws the recorded tokens."""
    _script(tmp_path, "sampled", """
        import torch, torch.nn as nn
        from typing import NamedTuple

        class Out(NamedTuple):
            logits: torch.Tensor
            tokens: torch.Tensor

        class Sampler(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(64, 16); self.head = nn.Linear(16, 64)
                self.gen = torch.Generator().manual_seed(1234)
            def forward(self, tok):
                logits = self.head(self.emb(tok))[:, -1]
                return Out(logits, torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen))

        torch.manual_seed(5)
        m = Sampler().eval()
        tok = torch.tensor([[7]])
        with torch.no_grad():
            for _ in range(8):
                tok = m(tok).tokens
    """)
    rec, _ = _record(tmp_path, "sampled", "--keyframe-every", "4")
    res = _replay("step", rec, "--rank", 0, "--step", 6, "--no-save", "--json", cwd=tmp_path)
    data = json.loads(res.stdout)
    assert res.returncode == 0 and data["headline"].startswith("reproduced"), data["headline"]
    assert data["modes"]["eager"]["vs_recording"]["tokens"]["verdict"] == "bitwise equal"
    assert any("torch.Generator" in n and "gen" in n for n in data["notes"]), data["notes"]


@pytest.mark.parametrize("kind", ["plain", "frozen_dataclass", "namedtuple"])
def test_a_step_taking_a_data_object_is_recorded_and_rerun(tmp_path: Path, kind: str) -> None:
    """``step(batch)`` where ``batch`` holds the step's tensors (and a scalar): its fields are
    recorded as inputs, and a re-run of a later step passes an object of the program's class
    holding that step's values (not the first call's object)."""
    holder = {
        "plain": "class Batch:\n    def __init__(self, ids, h, scale):\n        self.ids, self.h, self.scale = ids, h, scale",
        "frozen_dataclass": "@dataclass(frozen=True)\nclass Batch:\n    ids: torch.Tensor\n    h: torch.Tensor\n    scale: float",
        "namedtuple": "class Batch(NamedTuple):\n    ids: torch.Tensor\n    h: torch.Tensor\n    scale: float",
    }[kind]
    _script(tmp_path, "batched", "import torch, torch.nn as nn\nfrom dataclasses import dataclass\nfrom typing import NamedTuple\n"
            + holder + textwrap.dedent("""

        torch.manual_seed(2)
        emb = nn.Embedding(40, 16); rnn = nn.GRUCell(16, 16); head = nn.Linear(16, 40)

        def step(batch):
            h = rnn(emb(batch.ids), batch.h) * batch.scale
            logits = head(h)
            return logits, logits.argmax(-1), h

        if __name__ == "__main__":
            b = Batch(torch.tensor([1, 2]), torch.zeros(2, 16), 0.5)
            with torch.no_grad():
                for i in range(6):
                    logits, tok, h = step(b)
                    b = Batch(tok, h, 0.5 + i)
    """))
    rec, _ = _record(tmp_path, "batched", "--step", "batched:step")
    res = _replay("step", rec, "--rank", 0, "--step", 4, "--no-save", "--json", cwd=tmp_path)
    data = json.loads(res.stdout)
    assert res.returncode == 0 and data["headline"].startswith("reproduced: rank 0 step 4"), (data["headline"], res.stderr)
    assert data["modes"]["eager"]["departed"] is None
