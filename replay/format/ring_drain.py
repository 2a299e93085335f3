"""The record ring's drain as a process of its own (``RecordConfig.drain = "process"``).

Why a process: a drain thread of the recorded program turns each record into a journal frame in
Python, and every moment it holds the interpreter is a moment the program's own thread waits for
it. Measured on an H200's host, the program's own decode step ran ~0.6 ms slower while a drain
thread wrote its records, eager on CUDA and on the CPU alike (``benchmarks/diag/interleave.py``).
In a process of its own the drain shares nothing with the program but the ring.

It follows the ring from its tail: each job whose commit word is whole (written by the host, or
by the GPU's copy) becomes its frame exactly as salvage makes it (``ring_salvage.build_frame``),
its payload then its frame appended to the journal; then it moves the tail in the ring's header,
which is how the recording process learns that the room is free. A job whose bytes are not all in
the ring (``"x"`` in its meta) is written by the recording process itself: the drain waits until
the tail moves past it. It ends after the end marker (CLOSE), when the header's stop word is set
and nothing whole is left, or when the recording process is gone and nothing whole is left;
whatever it has not reached stays in the ring for ``replay seal`` to salvage.

Numpy only, no torch; it never runs code from the ring. Started by ``replay.record.drain``.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from replay.format.journal import FrameKind, JournalWriter
from replay.format.ring_salvage import (
    H_CAPACITY,
    H_STOP,
    H_TAIL_POS,
    H_TAIL_SEQ,
    H_WAITING,
    HEADER_BYTES,
    JOB_HEADER_BYTES,
    JOB_MAGIC,
    build_frame,
    read_job,
)

__all__ = ["run_drain", "child_main"]

# Idle polling: quick while a job is sealed and only its device copies are awaited, or while the
# recording process waits for room; otherwise slower the longer the program has been quiet. (A
# drain that overslept by milliseconds halved the full-logits writer's rate on an H200.)
POLL_MIN_S = 0.00005
POLL_MAX_S = 0.001


class _Drain:
    """The ring (mapped shared, read and write: the drain moves the tail words) and the journal."""

    def __init__(self, ring_path: Path, journal: Path, payload: Path, max_bytes: int | None) -> None:
        fd = os.open(ring_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        try:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.head = buf[:HEADER_BYTES].view(np.int64)
        self.cap = int(self.head[H_CAPACITY])
        self.data = buf[HEADER_BYTES : HEADER_BYTES + self.cap]
        self.w = JournalWriter.append_to(journal, payload, valid_bytes=os.path.getsize(journal))
        self.w.max_bytes = max_bytes
        self.last: dict[tuple[int, str], tuple[Any, ...]] = {}
        self.pos, self.seq = int(self.head[H_TAIL_POS]), int(self.head[H_TAIL_SEQ])
        self.stats = {"jobs": 0, "bytes": 0, "frame_s": 0.0, "write_s": 0.0, "sleep_s": 0.0, "sleeps": 0}

    def next_job(self) -> tuple[Any, ...] | None:
        """The job due now, when whole."""
        got = read_job(self.data, self.cap, self.pos, self.seq)
        if got is not None and got[0] == "wrap":
            # A wrap word is this lap's only if the job after it is the one due: a stale one
            # from an earlier lap must not move the tail past a job still to come.
            after = read_job(self.data, self.cap, got[1], self.seq)
            got = after if after is not None and after[0] == "job" else None
        return got

    def take(self, got: tuple[Any, ...]) -> FrameKind | None:
        """Write a whole job and move the tail past it; None when it is the recording process's
        to write (bytes outside the ring) and that process has not moved the tail past it yet."""
        _, jseq, meta, end = got
        if meta.get("x"):
            seq = int(self.head[H_TAIL_SEQ])
            if seq > jseq:  # written by the recording process, which stored the position before
                self.pos, self.seq = int(self.head[H_TAIL_POS]), seq
                self.last.clear()  # the payload grew under another writer
            return None
        if jseq != self.seq:
            raise RuntimeError(f"record ring job {jseq} found where job {self.seq} was due")
        t0 = time.perf_counter()
        self.w.refresh_sizes()  # the recording process may have appended (a job outside the ring)
        frame = build_frame(self.data, jseq, meta, base=self.w.payload_size, last=self.last)
        if frame is None:
            raise RuntimeError(f"record ring job {jseq} names bytes that are not in the ring")
        kind, body, views = frame
        t1 = time.perf_counter()
        if views:
            self.w.write_payloads(views)
        self.w.write_frame(kind, body)
        st = self.stats
        st["frame_s"] += t1 - t0
        st["write_s"] += time.perf_counter() - t1
        st["jobs"] += 1
        st["bytes"] += sum(v.nbytes for v in views)
        self.pos, self.seq = end, jseq + 1
        self.head[H_TAIL_POS] = self.pos  # (the position first, as ShmRing.release)
        self.head[H_TAIL_SEQ] = self.seq
        return kind

    def sleep(self, poll: float) -> None:
        t0 = time.perf_counter()
        time.sleep(poll)
        self.stats["sleep_s"] += time.perf_counter() - t0
        self.stats["sleeps"] += 1

    def close(self) -> None:
        self.w.close()
        # ``REPLAY_DRAIN_STATS=<file>``: where this drain's time went (a development aid:
        # ``benchmarks/diag/interleave.py --writer``).
        path = os.environ.get("REPLAY_DRAIN_STATS")
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps(self.stats) + "\n")
        self.head = self.data = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass


def run_drain(ring_path: Path, journal: Path, payload: Path, *, parent: int, max_bytes: int | None = None) -> int:
    """Drain until the end marker, a stop request or the parent's death; returns jobs written."""
    d = _Drain(ring_path, journal, payload, max_bytes)
    poll = POLL_MIN_S
    try:
        while True:
            got = d.next_job()
            kind = d.take(got) if got is not None and got[0] == "job" else None
            if kind == FrameKind.CLOSE:
                return d.stats["jobs"]
            if kind is not None:
                poll = POLL_MIN_S
                continue
            if got is not None and got[0] == "job" and d.seq > got[1]:
                continue  # the recording process wrote that job: go on from the new tail
            if d.head[H_STOP] or os.getppid() != parent:
                return d.stats["jobs"]
            if d.head[H_WAITING] or _sealed(d.data, d.cap, d.pos, d.seq):
                poll = POLL_MIN_S
            d.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
    finally:
        d.close()


def _sealed(data: np.ndarray, cap: int, pos: int, seq: int) -> bool:
    """Job ``seq``'s header is at ``pos`` (the host sealed it; its commit, a device copy, is to come)."""
    phys = pos % cap
    if phys + JOB_HEADER_BYTES > cap:
        return False
    h = data[phys : phys + 16].view(np.int64)
    return int(h[0]) & 0xFFFFFFFF == JOB_MAGIC and int(h[1]) == seq


def child_main(argv: list[str]) -> int:
    """The drain process's entry: one JSON argument (ring, journal, payload, parent, max_bytes).
    Exit 0 when done; 3 with one line on standard error when it failed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the program, which closes the recording
    a = json.loads(argv[0])
    try:
        run_drain(Path(a["ring"]), Path(a["journal"]), Path(a["payload"]), parent=int(a["parent"]), max_bytes=a.get("max_bytes"))
    except BaseException as e:  # noqa: BLE001 - one line for the recording process, never a traceback
        sys.stderr.write(f"{e.__class__.__name__}: {e}\n")
        return 3
    return 0
