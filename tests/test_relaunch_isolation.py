"""A re-launched program (``replay step`` on a recording with no factory) runs its start-up again:
it must not change the user's files, and it must get the stdin it was recorded with (issue 15's
session 8 trial: generations.jsonl emptied by a re-run; a program reading its prompts from stdin
could not be re-run).

Each script is written into the test's directory and recorded with `replay record -- python3
script.py`, as tests/test_newcomer_scripts.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.test_newcomer_scripts import _env

RERUN_ERROR = 7

pytestmark = pytest.mark.e2e


def _replay(*args: Any, cwd: Path, stdin: Any = subprocess.DEVNULL, data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=cwd, env=_env(),
                          stdin=None if data is not None else stdin, input=data, capture_output=True, timeout=300)


def _script(tmp: Path, name: str, text: str) -> None:
    (tmp / f"{name}.py").write_text(textwrap.dedent(text))


def _files(root: Path, skip: Path) -> dict[str, tuple[bytes, int]]:
    """Every file and directory under ``root`` (not under ``skip``): its bytes and modification time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p == skip or skip in p.parents:
            continue
        out[str(p.relative_to(root))] = (b"<dir>" if p.is_dir() else p.read_bytes(), p.stat().st_mtime_ns)
    return out


WRITER = """
    import json, logging, os, pathlib
    import torch, torch.nn as nn

    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 16)
            self.head = nn.Linear(16, 30)
        def forward(self, tok):
            return self.head(torch.tanh(self.emb(tok)))

    # Start-up writes, the ways programs make them; each one reads back what it wrote.
    out = open("generations.jsonl", "w")
    with open("runs.log", "a") as f:
        f.write("run\\n")
    runs = open("runs.log").read().count("run\\n")
    os.makedirs("out/ckpt", exist_ok=True)
    pathlib.Path("out/summary.json").write_text(json.dumps({"runs": runs}))
    assert json.loads(pathlib.Path("out/summary.json").read_text()) == {"runs": runs}
    torch.save({"w": torch.ones(2)}, "out/ckpt/model.pt.tmp")
    os.replace("out/ckpt/model.pt.tmp", "out/ckpt/model.pt")
    assert torch.load("out/ckpt/model.pt")["w"].sum() == 2 and not os.path.exists("out/ckpt/model.pt.tmp")
    if os.path.exists("stale.txt"):
        os.remove("stale.txt")
        assert not os.path.exists("stale.txt")
    fd = os.open("counter.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, b"0")
    os.close(fd)
    logging.basicConfig(filename="app.log", filemode="w", level=logging.INFO)
    logging.info("started, run %d", runs)

    lm = LM().eval()
    tok = torch.tensor([1])
    with torch.no_grad():
        for i in range(10):
            tok = lm(tok).argmax(-1)
            out.write(json.dumps({"step": i, "token": tok.item()}) + "\\n")
    out.close()
"""


def test_a_re_launched_program_s_file_writes_leave_the_user_s_files_as_they_were(tmp_path: Path) -> None:
    """The program truncates, appends, makes directories, saves with torch.save and replaces
    atomically, removes a file and logs, at start-up: in the re-launch all of that goes to a
    scratch directory (what it reads back is what it wrote), and the user's files are the same
    bytes, untouched, afterwards."""
    _script(tmp_path, "writer", WRITER)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "writer.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len((tmp_path / "generations.jsonl").read_text().splitlines()) == 10
    (tmp_path / "stale.txt").write_text("the user's, not the program's\n")
    before = _files(tmp_path, rec)
    res = _replay("step", rec, "--step", 8, "--no-save", cwd=tmp_path)
    out = res.stdout.decode()
    assert res.returncode == 0 and out.startswith("reproduced: rank 0 step 8"), out + res.stderr.decode()[-2000:]
    assert _files(tmp_path, rec) == before  # not one byte, time or name changed
    assert "note: the re-launched program wrote 6 file(s): they went to a scratch directory, deleted now" in out, out


STDIN_READER = """
    import sys
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 24)
            self.cell = nn.GRUCell(24, 24)
            self.head = nn.Linear(24, 40)
            self.register_buffer("h", torch.zeros(1, 24))
        def forward(self, tok):
            h = self.cell(self.emb(tok), self.h)
            self.h.copy_(h)
            return self.head(h)

    torch.manual_seed(0)
    lm = LM().eval()
    with torch.no_grad():
        for line in sys.stdin:
            prompt = [int(t) for t in line.split()]
            lm.h.zero_()
            for t in prompt:
                logits = lm(torch.tensor([t]))
            out = []
            for _ in range(6):
                tok = logits.argmax(-1)
                out.append(tok.item())
                logits = lm(tok)
            print(prompt, "->", out)
"""


def test_a_program_reading_its_prompts_from_stdin_is_re_run_with_the_stdin_it_was_given(tmp_path: Path) -> None:
    """Recorded with a pipe on stdin, the program prints what it prints without replay, the
    recording keeps a copy of its stdin (which verify takes in its stride), and a re-launch gets
    it again, reaching a step of the second prompt. Without the copy (an older recording), the
    error says that the program may have read stdin."""
    _script(tmp_path, "reader", STDIN_READER)
    prompts = b"3 5 7\n1 2\n"
    plain = subprocess.run([sys.executable, "reader.py"], cwd=tmp_path, env=_env(), input=prompts,
                           capture_output=True, timeout=120)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--keyframe-every", 1, "--out", rec, "--", sys.executable, "reader.py",
                cwd=tmp_path, data=prompts)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == plain.stdout and plain.stdout.count(b"->") == 2
    assert (rec / "stdin.bin").read_bytes() == prompts
    assert _replay("verify", rec, cwd=tmp_path).returncode == 0
    res = _replay("step", rec, "--step", 15, "--no-save", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.decode().startswith("reproduced: rank 0 step 15"), res.stdout + res.stderr
    (rec / "stdin.bin").unlink()
    res = _replay("step", rec, "--step", 15, "--no-save", cwd=tmp_path)
    err = res.stderr.decode()
    assert res.returncode == RERUN_ERROR and "without calling the recorded step" in err, err
    assert "it may have read its stdin, which the recording did not keep" in err, err


def test_stdin_is_passed_on_whole_and_a_terminal_is_left_to_the_program(tmp_path: Path) -> None:
    """A stdin over the size limit reaches CMD whole, and no partial copy is kept (one line says
    so); a terminal stays the program's own, not copied."""
    data = os.urandom((64 << 20) + 1000)
    p = _replay("record", "--quiet", "--out", tmp_path / "big", "--", "cat", cwd=tmp_path, data=data)
    assert p.returncode == 0 and p.stdout == data  # byte for byte what cat was given
    assert not (tmp_path / "big" / "stdin.bin").exists()
    assert b"no copy of CMD's stdin was kept (it is over 64 MiB)" in p.stderr, p.stderr[-2000:]
    leader, follower = os.openpty()
    try:
        p = _replay("record", "--quiet", "--out", tmp_path / "tty", "--", sys.executable, "-c",
                    "import os; print(os.isatty(0))", cwd=tmp_path, stdin=follower)
    finally:
        os.close(follower)
        os.close(leader)
    assert p.returncode == 0 and p.stdout.strip() == b"True", p.stderr[-2000:]
    assert not (tmp_path / "tty" / "stdin.bin").exists()
