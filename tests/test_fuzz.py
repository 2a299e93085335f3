"""Damaged and hostile recordings: every command answers in one line, or correctly; never more.

Real recordings (written by the real recorder, every kind of frame) are mutated byte by byte
(truncated, bytes flipped, regions overwritten) and structurally (tables of the wrong dtype,
shape or an absurd size, missing groups, odd attributes, a newer format version, journal frames
with hostile JSON and valid checksums, manifests that are not JSON, links to /dev/zero, FIFOs,
directories where files should be). Each case is opened by every command (``info``, ``info
--json``, ``verify``, ``seal``, and ``report``/``step``/``bisect`` where they exist) in a worker
process (``tests/scripts/fuzz_worker.py``) with a per-case timeout and a capped address space.

A command passes when it exits 0, or exits non-zero with exactly one ``replay: error:`` line on
stderr (``verify`` may instead report the damage on stdout); it fails on a traceback, an internal
error (exit 70), more than one stderr line, a hang, a crash of the worker or a memory blow-up.

Figures: ``pytest -s`` prints a summary line; ``REPLAY_FUZZ_STATS=path`` writes it as JSON.
``REPLAY_FUZZ_CASES`` sets the number of random cases (fast suite: 60; ``-m slow``: 2,000).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from replay import Recorder, RecorderConfig
from replay.format.journal import _HEADER, MAGIC, FrameKind, read_journal
from tests.factories import step_inputs, step_logits

WORKER = Path(__file__).parent / "scripts" / "fuzz_worker.py"
REPO = Path(__file__).resolve().parent.parent
CASE_TIMEOUT = 30.0  # seconds one command may take on a damaged recording before it counts as a hang
MEMORY_MB = 1500  # growth of the worker's peak RSS that counts as a blow-up


EVIL = '''
import os
open(os.environ["REPLAY_EVIL_MARKER"], "w").write("imported")

def build(*args, **kwargs):
    open(os.environ["REPLAY_EVIL_MARKER"], "w").write("called")
'''


# -- the worker -------------------------------------------------------------------------------


class Worker:
    """A long-lived ``fuzz_worker.py``: restarted after a case that hangs or kills it."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1, env=self.env, cwd=REPO,
        )
        first = self.run(["--version"], cwd=REPO, timeout=120.0)
        assert first.get("code") == 0, first
        self.base_rss = float(first["rss_mb"])

    def run(self, argv: list[str], *, cwd: Path, timeout: float = CASE_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.restarts += 1
            self._start()
            return {"hang": True}
        line = self.proc.stdout.readline()
        if not line:
            return self._died()
        return json.loads(line)

    def _died(self) -> dict[str, Any]:
        rc = self.proc.wait()
        self.restarts += 1
        self._start()
        return {"crash": rc}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A module that leaves a mark when imported: recordings below name it as their factory."""
    d = tmp_path_factory.mktemp("evil")
    (d / "evil_factory.py").write_text(EVIL)
    return {"dir": d, "marker": d / "imported.txt"}


@pytest.fixture(scope="module")
def worker(evil: dict[str, Path]) -> Any:
    # The evil module is importable in every case: no command that reads a recording may import it.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(evil["dir"]), str(REPO)]), REPLAY_EVIL_MARKER=str(evil["marker"]),
               REPLAY_FUZZ_SECRET=SECRET)
    w = Worker(env=env)
    yield w
    w.close()


def judge(res: dict[str, Any], worker: Worker) -> str | None:
    """Why a command's answer is not acceptable, or None."""
    if res.get("hang"):
        return "hang"
    if "crash" in res:
        return f"worker died (exit {res['crash']})"
    out, err, code = res["out"], res["err"], res["code"]
    if "Traceback" in out or "Traceback" in err:
        return "traceback"
    if code == 70:
        return "internal error"
    if code == -1:
        return "main() raised"
    if res["rss_mb"] - worker.base_rss > MEMORY_MB:
        return f"memory blow-up ({res['rss_mb']:.0f} MB)"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("replay: error:")]
    if code == 0:
        return None if not errors else "an error line, and exit 0"
    # Besides its error, a failing command may have said what it was doing, one "replay: ..."
    # line each (``step`` names the factory it imports, before importing it).
    if len(errors) > 1 or any(not ln.startswith("replay: ") for ln in lines) or len(lines) > 3:
        return "more than one stderr line"
    if not out.strip() and (len(errors) != 1 or lines[-1] != errors[0]):
        return "non-zero exit without one error line"
    return None


def commands(rec: Path, case: Path, *, report: bool = True) -> list[tuple[str, list[str]]]:
    """Every command that reads a recording, ``seal`` (which writes) last.

    ``report``: also ``replay report`` (which renders plots: ten times the others' cost).
    """
    p = str(rec)
    cmds = [
        ("info", ["info", p]),
        ("info --json", ["info", "--json", p]),
        ("verify", ["verify", p]),
        ("verify --quick --json", ["verify", "--quick", "--json", p]),
    ]
    if report and importlib.util.find_spec("replay.cli.report") is not None:
        cmds.append(("report --json", ["report", "--json", p, "-o", str(case / "report.html")]))
    if importlib.util.find_spec("replay.cli.diff") is not None:  # issue 17
        cmds.append(("diff --json", ["diff", "--json", p, p]))
    if importlib.util.find_spec("replay.cli.bisect") is not None:
        cmds.append(("bisect --steps", ["bisect", p, "--steps", "--no-save"]))
    if importlib.util.find_spec("replay.cli.step") is not None:
        cmds.append(("step", ["step", p, "--rank", "0", "--step", "1", "--mode", "eager", "--device", "cpu", "--no-save"]))
    cmds.append(("seal", ["seal", p]))
    return cmds


# -- real recordings to start from ------------------------------------------------------------


def record_rich(out: Path, *, ranks: int = 2, steps: int = 6, journal_copy: Path | None = None) -> None:
    """A recording with every kind of frame: target, graph and kernels, tuner, collectives (in
    full), replays, keyframes, the logits ring, tokens, arguments, notes, a raised step, and a
    divergence on rank 1. ``journal_copy``: also keep each rank's journal as a crash leaves it."""
    for r in range(ranks):
        state = {"kv": torch.zeros(2, 3)}
        rec = Recorder(
            RecorderConfig(out=out, part="run-000", rank=r, world_size=ranks, keyframe_every=2, ring=2, collectives="full"),
            state_fn=lambda: state,
        )
        rec.set_target({"step": "fuzz_target:Engine.step", "factory": "fuzz_no_such_module:build", "config": {"width": 8}})
        rec.record_graph("bs=4", padded_size=4, kernels=[{"name": "gemm", "grid": [1, 2, 3], "block": [32, 1, 1]}], source="test")
        rec.record_tuner({"matmul": f"tactic{r}"})
        for s in range(steps):
            rec.begin_step()
            inputs = step_inputs(s)
            rec.record_inputs(**inputs)
            rec.record_args(pos=s, mode="decode")
            h = inputs["hidden"].float()
            rec.record_collective("all_reduce", group="default", group_size=ranks, inputs=[h], outputs=[h * ranks])
            rec.record_graph_replay(0)
            logits = step_logits(s)
            if r == 1 and s >= 4:
                logits[0, 0] += 1e-3
            state["kv"] += 1
            rec.record_outputs(logits=logits, tokens=logits.argmax(-1), accepted=torch.ones(4, dtype=torch.int64))
            rec.set_run("graph", key="bs=4", padded_size=4)
            rec.end_step(error=ValueError("injected") if (r == 0 and s == steps - 1) else None)
            rec.note(f"note {s}")
        if journal_copy is not None:
            assert rec.drain()  # issue 15: the records still in the ring, into the journal first
            part = journal_copy / "run-000"
            part.mkdir(parents=True, exist_ok=True)
            for ext in ("journal", "payload"):
                shutil.copy(out / "run-000" / f"rank-{r:05d}.{ext}", part / f"rank-{r:05d}.{ext}")
        rec.close()
        assert rec.error is None, rec.error
    if journal_copy is not None:
        shutil.copy(out / "manifest.json", journal_copy / "manifest.json")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    record_rich(root / "sealed", journal_copy=root / "journal")
    return {"sealed": root / "sealed", "journal": root / "journal"}


# -- mutations --------------------------------------------------------------------------------


def _files(case: Path, *suffixes: str) -> list[Path]:
    return sorted(p for p in case.rglob("*") if p.is_file() and not p.is_symlink() and (not suffixes or p.suffix in suffixes))


def m_truncate(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    n = f.stat().st_size
    at = rng.choice([0, 1, rng.randrange(n + 1), max(0, n - rng.randrange(1, 64))])
    os.truncate(f, at)
    return f"truncate {f.name} at {at}/{n}"


def m_flip(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    data = bytearray(f.read_bytes())
    if not data:
        return m_truncate(case, rng)
    k = rng.choice([1, 2, 4, 16])
    for _ in range(k):
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
    f.write_bytes(bytes(data))
    return f"flip {k} bytes of {f.name}"


def m_overwrite(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    data = bytearray(f.read_bytes())
    if not data:
        return m_truncate(case, rng)
    at = rng.randrange(len(data))
    n = min(len(data) - at, rng.choice([8, 64, 512, 4096]))
    fill = rng.choice([b"\x00", b"\xff", None])
    data[at : at + n] = bytes(rng.randrange(256) for _ in range(n)) if fill is None else fill * n
    f.write_bytes(bytes(data))
    return f"overwrite {n} bytes of {f.name} at {at} with {fill!r}"


def m_append(case: Path, rng: random.Random) -> str:
    f = rng.choice(_files(case))
    with open(f, "ab") as fh:
        fh.write(bytes(rng.randrange(256) for _ in range(rng.choice([1, 16, 1000]))))
    return f"append garbage to {f.name}"


_TABLES = ["steps", "fields", "tensors", "graphs", "kernels", "replays", "collectives", "keyframes", "tuner"]
_HOSTILE_INTS = [-1, 0, 1, -(2**31), 2**31 - 1, -(2**62), 2**62, 2**40, 10**12]


def _h5(case: Path, rng: random.Random) -> Path | None:
    files = _files(case, ".h5")
    return rng.choice(files) if files else None


def m_h5_table(case: Path, rng: random.Random) -> str:
    """A table of the wrong dtype, shape, kind or size; or a missing one."""
    f = _h5(case, rng)
    if f is None:
        return m_journal_json(case, rng)
    name = rng.choice(_TABLES + ["strings", "events", "payload"])
    how = rng.choice(["delete", "dtype", "2d", "group", "huge", "empty", "scalar"])
    with h5py.File(f, "r+") as h:
        old = h[name] if name in h else None
        dtype = old.dtype if isinstance(old, h5py.Dataset) else np.dtype("i8")
        if name in h:
            del h[name]
        if how == "dtype":
            h.create_dataset(name, data=np.arange(5, dtype=rng.choice(["f8", "i4", "u1", "S4"])))
        elif how == "2d":
            h.create_dataset(name, shape=(3, 2), dtype=dtype)
        elif how == "group":
            h.create_group(name)
        elif how == "huge":
            # Claims 2**40 rows; stored sparse, so the file stays small.
            h.create_dataset(name, shape=(2**40,), dtype=dtype, chunks=(1024,), maxshape=(None,))
        elif how == "empty":
            h.create_dataset(name, shape=(0,), dtype=dtype)
        elif how == "scalar":
            h.create_dataset(name, data=np.int64(7))
    return f"{how} /{name} of {f.name}"


def m_h5_rows(case: Path, rng: random.Random) -> str:
    """Absurd values in the rows of a table (offsets, sizes, shapes, string ids, steps)."""
    f = _h5(case, rng)
    if f is None:
        return m_journal_json(case, rng)
    name = rng.choice(_TABLES)
    with h5py.File(f, "r+") as h:
        ds = h[name]
        if not ds.shape[0]:
            return f"(empty /{name})"
        data = ds[()]
        col = rng.choice(data.dtype.names)
        rows = rng.sample(range(len(data)), k=min(len(data), rng.choice([1, 3, len(data)])))
        for i in rows:
            if data.dtype[col].kind == "f":
                with np.errstate(over="ignore"):  # 1e300 into a float32 column: inf, on purpose
                    data[col][i] = rng.choice([np.nan, np.inf, -np.inf, 1e300, -1.0])
            else:
                info = np.iinfo(data.dtype[col].base)
                data[col][i] = rng.choice([info.min, info.max, 0, 1, *(v for v in _HOSTILE_INTS if info.min <= v <= info.max)])
        ds[...] = data
    return f"rows {rows} of /{name}.{col} in {f.name}"


def m_h5_attrs(case: Path, rng: random.Random) -> str:
    f = _h5(case, rng)
    if f is None:
        return m_manifest(case, rng)
    key = rng.choice(["format_version", "kind", "world_size", "rank", "complete", "config", "target", "journal_problem", "lost_bytes", "host", "node_rank"])
    value: Any = rng.choice([
        None, 2, 99, "1", 1.5, -1, 2**40, np.arange(3), np.arange(5000), "not json {", "[" * 5000, json.dumps([1] * 10),
        "x" * 100_000, True, np.float64(np.nan),
    ])
    with h5py.File(f, "r+") as h:
        if value is None:
            if key in h.attrs:
                del h.attrs[key]
        else:
            h.attrs[key] = value
    return f"attr {key}={str(value)[:40]!r} in {f.name}"


def m_newer_version(case: Path, rng: random.Random) -> str:
    f = _h5(case, rng)
    if f is not None and rng.random() < 0.5:
        with h5py.File(f, "r+") as h:
            h.attrs["format_version"] = 2
        return f"format_version 2 in {f.name}"
    m = case / "manifest.json"
    data = json.loads(m.read_text())
    data["format_version"] = 2
    m.write_text(json.dumps(data))
    return "format_version 2 in manifest.json"


def _hostile_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, -1, 0, 2**63, -(2**63) - 1, 2**70, 10**400 if False else 1e308, float("nan"), "", "zz",
        "ffffffffffffffffff", "bfloat99", [], {}, [[[]]], [-5, 3], [2**40, 2**40], ["x"], {"a": 1}, "x" * 10_000,
        list(range(20)),
    ])


def _encode(kind: int, body: bytes) -> bytes:
    import zlib

    return _HEADER.pack(MAGIC, kind, 0, len(body), zlib.crc32(body)) + body


def _rewrite_journal(j: Path, edit: Callable[[list[tuple[int, Any]]], None]) -> None:
    scan = read_journal(j)
    frames: list[tuple[int, Any]] = [(int(f.kind), f.body) for f in scan.frames]
    edit(frames)
    out = b""
    for kind, body in frames:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out += _encode(kind, raw)
    j.write_bytes(out)


def m_journal_json(case: Path, rng: random.Random) -> str:
    """Hostile JSON in a frame, with a valid checksum: the reader's own checks must catch it."""
    js = _files(case, ".journal")
    if not js:
        return m_h5_rows(case, rng)
    j = rng.choice(js)
    what: list[str] = []

    def edit(frames: list[tuple[int, Any]]) -> None:
        i = rng.randrange(len(frames))
        kind, body = frames[i]
        how = rng.choice(["value", "value", "value", "delete", "kind", "drop", "dup", "deep", "huge-list"])
        if how == "kind":
            frames[i] = (rng.choice([int(k) for k in FrameKind] + [0, 99, 65535]), body)
        elif how == "drop":
            del frames[i]
        elif how == "dup":
            frames.insert(i, (kind, body))
        elif how == "deep":
            frames[i] = (kind, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        elif how == "huge-list":
            body = dict(body)
            body[rng.choice(list(body) or ["x"])] = [{"name": "x", "dtype": "float32", "shape": [1], "dig": "00"}] * 20_000
            frames[i] = (kind, body)
        else:
            # Walk to a random node and replace (or delete) it.
            node: Any = body
            path: list[Any] = []
            while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
                k = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
                if not isinstance(node[k], (dict, list)) or not node[k]:
                    break
                path.append(k)
                node = node[k]
            if isinstance(node, dict) and node:
                k = rng.choice(list(node))
                if how == "delete":
                    del node[k]
                else:
                    node[k] = _hostile_value(rng)
                path.append(k)
            elif isinstance(node, list) and node:
                k = rng.randrange(len(node))
                node[k] = _hostile_value(rng)
                path.append(k)
        what.append(f"{how} in frame {i} ({FrameKind(kind).name if kind in set(FrameKind) else kind})")

    _rewrite_journal(j, edit)
    return f"journal {j.name}: {what[0] if what else 'unchanged'}"


def m_journal_length(case: Path, rng: random.Random) -> str:
    """A frame header claiming an absurd length (valid magic), at a frame boundary or the end."""
    js = _files(case, ".journal")
    if not js:
        return m_flip(case, rng)
    j = rng.choice(js)
    scan = read_journal(j)
    data = bytearray(j.read_bytes())
    at = rng.choice([f.offset for f in scan.frames] + [len(data)])
    head = _HEADER.pack(MAGIC, int(FrameKind.STEP), 0, rng.choice([2**32 - 1, 64 << 20, (64 << 20) + 1, 10**9]), 0)
    data[at : at + _HEADER.size] = head
    j.write_bytes(bytes(data))
    return f"journal {j.name}: frame at {at} claims a huge length"


def m_manifest(case: Path, rng: random.Random) -> str:
    m = case / "manifest.json"
    how = rng.choice(["notjson", "list", "deep", "version-str", "kind", "command", "empty", "huge", "binary"])
    if m.is_symlink() or not m.is_file():
        m.unlink(missing_ok=True)
    if how == "notjson":
        m.write_text("{not json")
    elif how == "list":
        m.write_text("[1, 2, 3]")
    elif how == "deep":
        m.write_text("[" * 200_000 + "]" * 200_000)
    elif how == "version-str":
        m.write_text(json.dumps({"format_version": "1", "kind": "replay-recording"}))
    elif how == "kind":
        m.write_text(json.dumps({"format_version": 1, "kind": "something-else"}))
    elif how == "command":
        m.write_text(json.dumps({"format_version": 1, "kind": "replay-recording", "command": rng.choice([[1, 2], {"a": 1}, 5, None, [None]])}))
    elif how == "empty":
        m.write_text("")
    elif how == "huge":
        with open(m, "wb") as fh:
            fh.truncate(17 << 20)  # sparse: 17 MB of zeros
    elif how == "binary":
        m.write_bytes(bytes(range(256)))
    return f"manifest.json: {how}"


def m_special_file(case: Path, rng: random.Random) -> str:
    """A link to /dev/zero or /dev/urandom, a FIFO, a directory or a dangling link where a file
    should be."""
    candidates = _files(case) + [case / "manifest.json"]
    f = rng.choice(candidates)
    how = rng.choice(["zero", "urandom", "fifo", "dir", "dangling", "loop"])
    if f.exists() or f.is_symlink():
        f.unlink()
    if how == "zero":
        f.symlink_to("/dev/zero")
    elif how == "urandom":
        f.symlink_to("/dev/urandom")
    elif how == "fifo":
        os.mkfifo(f)
    elif how == "dir":
        f.mkdir()
    elif how == "dangling":
        f.symlink_to(case / "no-such-file")
    elif how == "loop":
        f.symlink_to(f)
    return f"{f.name} is a {how}"


def m_layout(case: Path, rng: random.Random) -> str:
    """Files and directories moved around: a part missing, extra junk, odd rank numbers."""
    how = rng.choice(["no-part", "junk-rank", "huge-rank", "both-h5-and-journal", "no-payload", "empty-journal", "extra-part"])
    part = case / "run-000"
    if how == "no-part":
        shutil.rmtree(part)
    elif how == "junk-rank":
        (part / "rank-00007.h5").write_text("this is not hdf5")
    elif how == "huge-rank":
        src = next(iter(_files(part, ".h5", ".journal")), None)
        if src is not None:
            shutil.copy(src, part / f"rank-99999999999{src.suffix}")
    elif how == "both-h5-and-journal":
        (part / "rank-00000.journal").write_bytes(_encode(int(FrameKind.HEADER), b'{"rank": 0, "world_size": 2}'))
    elif how == "no-payload":
        for p in _files(part, ".payload"):
            p.unlink()
    elif how == "empty-journal":
        (part / "rank-00001.journal").write_bytes(b"")
        (part / "rank-00001.h5").unlink(missing_ok=True)
    elif how == "extra-part":
        (case / "run-001").mkdir()
        (case / "run-001" / "rank-00000.journal").write_bytes(os.urandom(100))
    return f"layout: {how}"


def m_h5_hostile(case: Path, rng: random.Random) -> str:
    """What the writer never writes (issue 16): external storage, links, virtual datasets, sparse
    tables (the named cases below, applied at random among the other mutations)."""
    if not _rank0(case).is_file() or _rank0(case).is_symlink():
        return m_h5_table(case, rng)
    fn = rng.choice([_external_strings, _external_link, _soft_link, _virtual, _sparse_chunked])
    fn(case)
    return f"hostile: {fn.__name__.strip('_')}"


MUTATORS: list[tuple[Callable[[Path, random.Random], str], int]] = [
    (m_truncate, 3), (m_flip, 4), (m_overwrite, 2), (m_append, 1),
    (m_h5_table, 3), (m_h5_rows, 3), (m_h5_attrs, 2), (m_newer_version, 1),
    (m_journal_json, 4), (m_journal_length, 1), (m_manifest, 2), (m_special_file, 2), (m_layout, 2),
    (m_h5_hostile, 2),
]


# -- the loop ---------------------------------------------------------------------------------


@dataclass
class FuzzStats:
    cases: int = 0
    command_runs: int = 0
    failures: Counter = field(default_factory=Counter)
    exit_codes: Counter = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)
    max_rss_mb: float = 0.0
    slowest_s: float = 0.0
    secs: Counter = field(default_factory=Counter)  # time spent per command

    def to_json(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "command_runs": self.command_runs,
            "tracebacks": self.failures["traceback"],
            "internal_errors": self.failures["internal error"],
            "hangs": self.failures["hang"],
            "crashes": sum(v for k, v in self.failures.items() if k.startswith("worker died")),
            "failures": dict(self.failures),
            "exit_codes": {str(k): v for k, v in sorted(self.exit_codes.items(), key=lambda kv: str(kv[0]))},
            "max_rss_mb": round(self.max_rss_mb, 1),
            "slowest_command_s": round(self.slowest_s, 2),
            "seconds_per_command": {k: round(v, 1) for k, v in self.secs.most_common()},
            "examples": self.examples[:20],
        }


def run_case(worker: Worker, case: Path, description: str, stats: FuzzStats, *, report: bool = True) -> None:
    stats.cases += 1
    for name, argv in commands(case, case.parent / (case.name + "-out"), report=report):
        (case.parent / (case.name + "-out")).mkdir(exist_ok=True)
        res = worker.run(argv, cwd=case.parent)
        stats.command_runs += 1
        stats.exit_codes[res.get("code", "hang" if res.get("hang") else "crash")] += 1
        stats.max_rss_mb = max(stats.max_rss_mb, float(res.get("rss_mb", 0.0)))
        stats.slowest_s = max(stats.slowest_s, float(res.get("secs", 0.0)))
        stats.secs[name] += float(res.get("secs", 0.0))
        why = judge(res, worker)
        if why is not None:
            stats.failures[why] += 1
            stats.examples.append({"case": case.name, "mutation": description, "command": name, "why": why,
                                   "code": res.get("code"), "err": str(res.get("err", ""))[-1500:], "out": str(res.get("out", ""))[-500:]})


def fuzz(worker: Worker, bases: dict[str, Path], root: Path, n: int, seed: int, report_every: int = 1) -> FuzzStats:
    stats = FuzzStats()
    fns, weights = zip(*MUTATORS)
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        base = rng.choice(sorted(bases))
        case = root / f"case{i:05d}"
        shutil.copytree(bases[base], case, symlinks=True)
        descs = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            fn = rng.choices(fns, weights)[0]
            try:
                descs.append(fn(case, rng))
            except Exception as e:  # noqa: BLE001 - a second mutation may not apply to what the first left
                descs.append(f"{fn.__name__} did not apply ({e.__class__.__name__})")
        before = sum(stats.failures.values())
        run_case(worker, case, f"{base}: " + "; ".join(descs), stats, report=i % report_every == 0)
        if sum(stats.failures.values()) == before:
            _rmtree(case)
            _rmtree(root / f"case{i:05d}-out")
    return stats


def _rmtree(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p, ignore_errors=True)


def report(stats: FuzzStats, label: str) -> None:
    data = stats.to_json()
    print(f"\nreplay fuzz ({label}): {data['cases']} cases, {data['command_runs']} command runs, "
          f"{data['tracebacks']} tracebacks, {data['internal_errors']} internal errors, {data['hangs']} hangs, "
          f"{data['crashes']} worker crashes, max RSS {data['max_rss_mb']:.0f} MB, slowest {data['slowest_command_s']} s; "
          f"seconds per command {data['seconds_per_command']}")
    path = os.environ.get("REPLAY_FUZZ_STATS")
    if path:
        p = Path(path)
        existing = json.loads(p.read_text()) if p.exists() else {}
        existing[label] = data
        p.write_text(json.dumps(existing, indent=2))


def _fail_message(stats: FuzzStats) -> str:
    lines = [f"{sum(stats.failures.values())} bad answers: {dict(stats.failures)}"]
    for e in sorted(stats.examples, key=lambda e: e["why"] != "internal error")[:8]:
        lines.append(f"- {e['case']} [{e['mutation']}] `{e['command']}` -> {e['why']} (exit {e['code']}): {e['err'].strip()[-600:]}")
    return "\n".join(lines)


def test_fuzz_damaged_recordings(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    n = int(os.environ.get("REPLAY_FUZZ_CASES", "60"))
    stats = fuzz(worker, bases, tmp_path, n, seed=1, report_every=6)
    report(stats, "fast")
    assert not stats.failures, _fail_message(stats)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_many(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    n = int(os.environ.get("REPLAY_FUZZ_SLOW_CASES", "2000"))
    stats = fuzz(worker, bases, tmp_path, n, seed=2)
    report(stats, "slow")
    assert not stats.failures, _fail_message(stats)


# -- named cases: what each hostile input must say ---------------------------------------------


def _one_line(res: dict[str, Any], worker: Worker) -> str:
    assert judge(res, worker) is None, res
    lines = res["err"].strip().splitlines()
    assert res["code"] != 0 and len(lines) == 1, res
    return lines[0]


@pytest.mark.parametrize(
    "mutate, expect_code, expect_text, partial",
    [
        pytest.param(lambda c: _set_attr(c, "format_version", 2), 5, "upgrade replay", False, id="newer-h5-version"),
        pytest.param(lambda c: _manifest(c, {"format_version": 7, "kind": "replay-recording"}), 5, "format version 7", False, id="newer-manifest-version"),
        pytest.param(lambda c: (c / "manifest.json").write_text("{nope"), 4, "manifest.json is not valid JSON", False, id="manifest-not-json"),
        pytest.param(lambda c: _replace(c / "manifest.json", "/dev/zero"), 4, "manifest.json", False, id="manifest-dev-zero"),
        pytest.param(lambda c: _fifo(c / "run-000" / "rank-00000.h5"), 4, "not a regular file", True, id="rank-file-fifo"),
        pytest.param(lambda c: _huge_table(c, "steps"), 4, "more than the file holds", True, id="table-claims-2**40-rows"),
        pytest.param(lambda c: _set_attr(c, "world_size", 2**40), 0, "", False, id="absurd-world-size"),
    ],
)
def test_named_hostile_case(worker: Worker, bases: dict[str, Path], tmp_path: Path, mutate: Callable[[Path], Any],
                            expect_code: int, expect_text: str, partial: bool) -> None:
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case, symlinks=True)
    mutate(case)
    res = worker.run(["info", str(case)], cwd=tmp_path)
    if expect_code == 0:
        assert res["code"] == 0 and judge(res, worker) is None, res
        return
    line = _one_line(res, worker)
    if partial:
        # One rank file damaged: `info` shows the other ranks, names the file left out and why,
        # and still exits with the damaged code.
        assert res["code"] == expect_code and "rank 0 cannot be read" in line, line
        assert "rank 0: left out" in res["out"] and expect_text in res["out"], res["out"]
        return
    assert res["code"] == expect_code and expect_text in line, line
    assert line.startswith("replay: error:")


def _set_attr(case: Path, key: str, value: Any) -> None:
    with h5py.File(case / "run-000" / "rank-00000.h5", "r+") as h:
        h.attrs[key] = value


def _manifest(case: Path, data: dict[str, Any]) -> None:
    (case / "manifest.json").write_text(json.dumps(data))


def _replace(f: Path, target: str) -> None:
    f.unlink()
    f.symlink_to(target)


def _fifo(f: Path) -> None:
    f.unlink()
    os.mkfifo(f)


def _huge_table(case: Path, name: str) -> None:
    with h5py.File(case / "run-000" / "rank-00000.h5", "r+") as h:
        dtype = h[name].dtype
        del h[name]
        h.create_dataset(name, shape=(2**40,), dtype=dtype, chunks=(1024,), maxshape=(None,))


def test_huge_journal_frame_length(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """A crashed journal whose last frame claims 4 GB: the frames before it are read, no more."""
    case = tmp_path / "case"
    shutil.copytree(bases["journal"], case)
    j = case / "run-000" / "rank-00001.journal"
    with open(j, "ab") as fh:
        fh.write(_HEADER.pack(MAGIC, int(FrameKind.STEP), 0, 2**32 - 1, 0) + b"{}")
    res = worker.run(["verify", "--json", str(case)], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 4, res
    ranks = {r["rank"]: r for r in json.loads(res["out"])["ranks"]}
    assert ranks[1]["steps"] == 6 and ranks[1]["state"] == "incomplete", ranks[1]
    assert "claims 4294967295 bytes" in " ".join(ranks[1]["problems"])


def test_bit_flip_in_a_table_is_damage_not_data(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """One bit changed in /fields after sealing (a digest): without a checksum it would read as a
    divergence that never happened. Every table is checksummed: verify names the file instead."""
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case)
    f = case / "run-000" / "rank-00001.h5"
    with h5py.File(f, "r") as h:
        chunk = h["fields"].id.get_chunk_info(0)
    data = bytearray(f.read_bytes())
    data[chunk.byte_offset + chunk.size // 2] ^= 0x04
    f.write_bytes(bytes(data))
    res = worker.run(["verify", "--json", str(case)], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 4, res
    ranks = {r["rank"]: r for r in json.loads(res["out"])["ranks"]}
    assert ranks[0]["state"] == "intact" and ranks[1]["state"] == "damaged"
    assert "checksum does not match" in ranks[1]["problems"][0]


# -- nothing in a recording is executed -------------------------------------------------------


def test_opening_a_recording_imports_nothing_it_names(worker: Worker, evil: dict[str, Path], tmp_path: Path) -> None:
    """A recording naming a factory whose import leaves a mark: reading commands never import it."""
    marker = evil["marker"]
    rec = tmp_path / "rec"
    record_rich(rec)
    with h5py.File(rec / "run-000" / "rank-00000.h5", "r+") as h:
        h.attrs["target"] = json.dumps({"factory": "evil_factory:build", "step": "evil_factory:build", "config": {}})
        h.attrs["config"] = json.dumps({"factory": "evil_factory:build"})
    m = json.loads((rec / "manifest.json").read_text())
    m.update(factory="evil_factory:build", settings={"factory": "evil_factory:build", "steps": ["evil_factory:build"]})
    (rec / "manifest.json").write_text(json.dumps(m))
    for name, argv in commands(rec, tmp_path):
        if name == "seal":
            continue
        # Run inside the directory holding the module (it is on the path), as a user who ran
        # `python -m replay step .` beside a shipped .py would.
        res = worker.run(argv, cwd=evil["dir"])
        assert judge(res, worker) is None, (name, res)
        assert not marker.exists(), f"`replay {name}` imported the factory named in the recording"
        if name == "step":
            # An edited recording: the signature no longer matches, so the re-run says what it
            # would import and from where, and how to consent (exit 8), and imports nothing.
            line = _one_line(res, worker)
            assert res["code"] == 8 and "evil_factory:build" in line and "evil_factory.py" in line, line
            assert "changed after it was signed" in line and "--trust" in line, line
    # The check would have seen an import.
    env = dict(os.environ, PYTHONPATH=str(evil["dir"]), REPLAY_EVIL_MARKER=str(marker))
    subprocess.run([sys.executable, "-c", "import evil_factory"], env=env, cwd=tmp_path, check=True)
    assert marker.exists()
    marker.unlink()


def test_no_pickle_or_eval_in_the_package() -> None:
    """Recordings are JSON, HDF5 attributes and raw bytes: nothing in replay/ unpickles or evals.

    Code a recording names is imported in one place (replay/rerun/imports.py, behind the trust
    check), for ``step``/``bisect`` only.
    """
    bad = re.compile(r"\bimport pickle\b|\bpickle\.|\bcPickle\b|(?<![\w.])eval\(|(?<![\w.])exec\(|torch\.load\(|"
                     r"allow_pickle\s*=\s*True|\bmarshal\.|yaml\.load\(|\bshelve\b")
    imports = re.compile(r"importlib\.import_module\(|__import__\(")
    # Fixed module names only: the lazy public surface and deferred torch import.
    allowed_imports = {"replay/rerun/imports.py", "replay/record/hooks.py", "replay/cli/main.py",
                       "replay/__init__.py", "replay/_lazy.py"}
    found, importers = [], []
    for p in sorted((REPO / "replay").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith("replay/workloads/"):
            continue  # the test subject, not the tool
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if bad.search(code):
                found.append(f"{rel}:{i}: {line.strip()}")
            if imports.search(code) and rel not in allowed_imports:
                importers.append(f"{rel}:{i}: {line.strip()}")
    assert not found, found
    assert not importers, importers


# -- CLI input: one line that says what is valid ------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.factories import make_recording

    root = tmp_path_factory.mktemp("cli")
    (root / "a-file").write_text("hello")
    (root / "empty").mkdir()
    return {"rec": make_recording(root, ranks=2, steps=3), "file": root / "a-file", "empty": root / "empty",
            "missing": root / "no-such-dir"}


@pytest.mark.parametrize(
    "args, code, words",
    [
        pytest.param(["info", "{missing}"], 3, "no recording at", id="info-missing-path"),
        pytest.param(["verify", "{missing}"], 3, "give the directory", id="verify-missing-path"),
        pytest.param(["seal", "{missing}"], 3, "no recording at", id="seal-missing-path"),
        pytest.param(["info", "{file}"], 4, "is a file, not a recording", id="info-a-file"),
        pytest.param(["info", "{empty}"], 4, "not a recording (no rank files found)", id="info-empty-dir"),
        pytest.param(["info", "--root", "{empty}"], 3, "no recording under", id="info-empty-root"),
        pytest.param(["info", "{rec}", "--part", "nosuch"], 2, "no part 'nosuch' (parts: run-000)", id="info-part-nosuch"),
        pytest.param(["verify", "{rec}", "--bogus"], 2, "No such option '--bogus'", id="unknown-option"),
        pytest.param(["nosuchcmd"], 2, "No such command 'nosuchcmd'", id="unknown-command"),
        pytest.param(["record", "--collectives", "bogus", "--", "true"], 2, "is not one of 'digest'", id="unknown-choice"),
        pytest.param(["record", "--durability", "x", "--", "true"], 2, "'step', 'async'", id="unknown-durability"),
    ],
)
def test_cli_input_gets_one_line(run_cli: Any, small: dict[str, Path], args: list[str], code: int, words: str) -> None:
    res = run_cli(*[a.format(**{k: str(v) for k, v in small.items()}) for a in args])
    lines = res.err.strip().splitlines()
    assert res.code == code and len(lines) == 1, (res.code, res.err)
    assert lines[0].startswith("replay: error:") and words in lines[0], lines[0]
    assert res.out == ""


def test_missing_rank_or_part_is_not_in_the_mapping(small: dict[str, Path]) -> None:
    """`in` and `.get` on a recording and a part answer, rather than raise (a killed rank has
    no file: callers ask whether it is there)."""
    from replay import open_recording

    with open_recording(small["rec"]) as rec:
        part = rec["run-000"]
        assert 0 in part and 7 not in part and part.get(7) is None and part.get(0) is part[0]
        assert "run-000" in rec and "nosuch" not in rec and rec.get("nosuch") is None


# -- hostile recordings (issue 16): the reader accepts only what the writer writes -------------------


SECRET = "replay-fuzz-secret-token-6b1f"


def _rank0(case: Path) -> Path:
    return case / "run-000" / "rank-00000.h5"


def _external_strings(case: Path) -> None:
    """/strings declared as external raw storage in /proc/self/environ: the user's tokens."""
    with h5py.File(_rank0(case), "r+") as h:
        del h["strings"]
        h.create_dataset("strings", shape=(64,), dtype="S64", external=[("/proc/self/environ", 0, 64 * 64)])


def _external_link(case: Path) -> None:
    """/steps an ExternalLink into another file (rank 1's)."""
    other = case / "other.h5"
    shutil.copy(case / "run-000" / "rank-00001.h5", other)
    with h5py.File(_rank0(case), "r+") as h:
        del h["steps"]
        h["steps"] = h5py.ExternalLink(str(other), "/steps")


def _soft_link(case: Path) -> None:
    with h5py.File(_rank0(case), "r+") as h:
        h.move("steps", "steps_elsewhere")
        h["steps"] = h5py.SoftLink("/steps_elsewhere")


def _virtual(case: Path) -> None:
    """/steps a virtual dataset mapping another file's table."""
    other = case / "other.h5"
    shutil.copy(case / "run-000" / "rank-00001.h5", other)
    with h5py.File(other, "r") as o:
        n, dtype = o["steps"].shape[0], o["steps"].dtype
    layout = h5py.VirtualLayout(shape=(n,), dtype=dtype)
    layout[:] = h5py.VirtualSource(str(other), "steps", shape=(n,))
    with h5py.File(_rank0(case), "r+") as h:
        del h["steps"]
        h.create_virtual_dataset("steps", layout)


SPARSE_BYTES = 3 << 30


def _sparse_huge(case: Path) -> None:
    """/steps contiguous and 3 GiB long, storage allocated in the file but never written: a file
    of kilobytes on disk that claims 3 GiB."""
    f = _rank0(case)
    with h5py.File(f, "r+") as h:
        dtype = h["steps"].dtype
        del h["steps"]
        n = SPARSE_BYTES // dtype.itemsize
        ds = h.create_dataset("steps", shape=(n,), dtype=dtype, fill_time="never")
        ds[n - 1] = np.zeros((), dtype=dtype)
    st = os.stat(f)
    assert st.st_size > SPARSE_BYTES and st.st_blocks * 512 < 64 << 20, (st.st_size, st.st_blocks)


def _sparse_chunked(case: Path) -> None:
    """/strings chunked and compressed, claiming 3 GiB of which no chunk is written."""
    with h5py.File(_rank0(case), "r+") as h:
        del h["strings"]
        h.create_dataset("strings", shape=(SPARSE_BYTES // 64,), dtype="S64", chunks=(1 << 16,),
                         compression="gzip", fletcher32=True)


def _escapes_in_names(case: Path) -> None:
    """Control characters in what names code and in the manifest: every line shows them escaped."""
    with h5py.File(_rank0(case), "r+") as h:
        h.attrs["target"] = json.dumps({"step": "x:Engine.step", "factory": "evil\x1b]0;pwned\x07:build", "config": {}})
        h.attrs["host"] = "host\x1b[2J"
    m = json.loads((case / "manifest.json").read_text())
    m["command"] = ["python", "\x1b]0;owned\x07run.py"]
    (case / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "mutate, reason",
    [
        pytest.param(_external_strings, "external storage", id="external-storage-proc-environ"),
        pytest.param(_external_link, "external link", id="external-link"),
        pytest.param(_soft_link, "soft link", id="soft-link"),
        pytest.param(_virtual, "virtual dataset", id="virtual-dataset"),
        pytest.param(_sparse_huge, "more than the file holds", id="sparse-3GiB-contiguous"),
        pytest.param(_sparse_chunked, "more than the file holds", id="sparse-3GiB-chunked"),
    ],
)
def test_hostile_rank_file_is_left_out(worker: Worker, bases: dict[str, Path], tmp_path: Path,
                                       mutate: Callable[[Path], None], reason: str) -> None:
    """What the writer never writes is never read: that rank is left out with one line naming
    the reason, exit 4; nothing from elsewhere (the environment, another file) is shown, and a
    sparse file is refused at once, within its real size in memory."""
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case, symlinks=True)
    mutate(case)
    for argv in (["info", str(case)], ["info", "--json", str(case)], ["verify", str(case)],
                 ["report", "--json", str(case), "-o", str(tmp_path / "report.html")]):
        if argv[0] == "report" and importlib.util.find_spec("replay.cli.report") is None:
            continue
        before = worker.base_rss
        res = worker.run(argv, cwd=tmp_path)
        assert judge(res, worker) is None, (argv, res)
        assert res["code"] == 4, (argv, res)
        text = res["out"] + res["err"]
        assert "rank 0" in text or "rank-00000" in text, (argv, text)
        assert reason in text, (argv, reason, text)
        assert SECRET not in text, "the environment was read through the rank file"
        assert res["secs"] < 1.0 or argv[0] == "report", (argv, res["secs"])
        assert res["rss_mb"] - before < 200, (argv, res["rss_mb"], before)
    html = tmp_path / "report.html"
    if html.exists():
        assert SECRET not in html.read_text(errors="replace")


def test_control_characters_in_names_reach_no_error_line(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """A factory name carrying an OSC title-set: the line that refuses to import it shows it escaped."""
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case, symlinks=True)
    _escapes_in_names(case)
    res = worker.run(["step", str(case), "--rank", "0", "--step", "1", "--mode", "eager", "--device", "cpu", "--no-save"],
                     cwd=tmp_path)
    line = _one_line(res, worker)
    assert res["code"] == 8 and "\x1b" not in line and "\\x1b]0;pwned" in line, line
    res = worker.run(["info", "--json", str(case)], cwd=tmp_path)
    assert "\x1b" not in res["out"], "JSON output must escape control characters"


def test_planted_default_recording_is_not_chosen(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """A ``recordings/99999999-...`` planted beside real recordings (sorting last by name, and
    claiming to start in the future) is not every command's default: the newest by start time is."""
    import time

    root = tmp_path / "recordings"
    root.mkdir()
    planted = root / "99999999-999999-planted"
    shutil.copytree(bases["sealed"], planted, symlinks=True)
    m = json.loads((planted / "manifest.json").read_text())
    m["started_at"] = time.time() + 10 ** 8
    (planted / "manifest.json").write_text(json.dumps(m))
    os.utime(planted / "manifest.json", (1.0, 1.0))
    real = root / "20261201-120000-real"
    shutil.copytree(bases["sealed"], real, symlinks=True)
    m = json.loads((real / "manifest.json").read_text())
    m["started_at"] = time.time()
    (real / "manifest.json").write_text(json.dumps(m))
    res = worker.run(["info", "--root", str(root)], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 0, res
    assert f"using the newest recording, {real}" in res["err"], res["err"]


def test_results_symlink_out_of_the_recording(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """``results`` a link to a directory elsewhere: ``bisect --steps`` (which saves its result)
    writes nothing there."""
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (case / "results").symlink_to(outside)
    res = worker.run(["bisect", str(case), "--steps"], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 0, res
    assert list(outside.iterdir()) == [], "a result was written through the link"


def test_sparse_payload_is_not_read(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """A crashed journal whose payload is a sparse 3 GiB file and names one tensor of 3 GiB:
    `verify` (which reads every stored tensor) reports it, without allocating for it."""
    case = tmp_path / "case"
    shutil.copytree(bases["journal"], case)
    j = case / "run-000" / "rank-00000.journal"
    payload = j.with_suffix(".payload")
    size = payload.stat().st_size

    def edit(frames: list[tuple[int, Any]]) -> None:
        for i, (kind, body) in enumerate(frames):
            if kind == int(FrameKind.STEP) and body.get("inputs"):
                body["inputs"][0] = {"name": "huge", "dtype": "uint8", "shape": [SPARSE_BYTES], "dig": "0" * 16,
                                     "off": size, "n": SPARSE_BYTES}
                return

    _rewrite_journal(j, edit)
    os.truncate(payload, size + SPARSE_BYTES)
    assert payload.stat().st_blocks * 512 < 64 << 20
    res = worker.run(["verify", "--json", str(case)], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 4, res
    ranks = {r["rank"]: r for r in json.loads(res["out"])["ranks"]}
    assert any("sparse" in p for p in ranks[0]["problems"]), ranks[0]
    assert res["secs"] < 1.0 and res["rss_mb"] - worker.base_rss < 200, res


def test_table_in_tiny_chunks_is_refused(worker: Worker, bases: dict[str, Path], tmp_path: Path) -> None:
    """A table cut into one chunk per row: a read per row is refused as not what the writer writes."""
    case = tmp_path / "case"
    shutil.copytree(bases["sealed"], case, symlinks=True)
    with h5py.File(_rank0(case), "r+") as h:
        data = h["fields"][()]
        del h["fields"]
        h.create_dataset("fields", data=np.resize(data, 5000), chunks=(1,), maxshape=(None,), fletcher32=True)
    res = worker.run(["info", str(case)], cwd=tmp_path)
    assert judge(res, worker) is None and res["code"] == 4, res
    assert "split into 5000 chunks" in res["out"], res["out"]


@pytest.mark.parametrize("args, code", [
    pytest.param(["info", "{missing}", "--json"], 3, id="missing"),
    pytest.param(["step", "{rec}", "--rank", "0", "--step", "99", "--json"], 2, id="step-out-of-range"),
    pytest.param(["info", "{rec}", "--part", "nosuch", "--json"], 2, id="part-nosuch"),
])
def test_json_errors_are_json_on_stdout(run_cli: Any, small: dict[str, Path], args: list[str], code: int) -> None:
    """A script that reads ``--json`` from stdout gets an error it can parse (it used to get
    nothing), and the one line on stderr stays."""
    res = run_cli(*[a.format(**{k: str(v) for k, v in small.items()}) for a in args])
    assert res.code == code and res.err.startswith("replay: error:"), (res.code, res.err)
    data = json.loads(res.out)
    assert data["kind"] == "error" and data["exit_code"] == code and data["error"] in res.err


def test_a_json_flag_of_the_recorded_program_is_not_replay_s(run_cli: Any) -> None:
    res = run_cli("record", "--collectives", "bogus", "--", "prog", "--json")
    assert res.code == 2 and res.out == ""
