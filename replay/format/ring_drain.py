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
from replay.format.ring_salvage import H_CAPACITY, H_STOP, H_TAIL_POS, H_TAIL_SEQ, HEADER_BYTES, build_frame, read_job

__all__ = ["run_drain", "child_main"]

# Idle polling: quick right after a job (the next step's record is usually on its way), slower
# when the program has been quiet for a while.
POLL_MIN_S = 0.0002
POLL_MAX_S = 0.004


def run_drain(ring_path: Path, journal: Path, payload: Path, *, parent: int, max_bytes: int | None = None) -> int:
    """Drain until the end marker, a stop request or the parent's death; returns jobs written."""
    fd = os.open(ring_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    buf = np.frombuffer(mm, dtype=np.uint8)
    head = buf[:HEADER_BYTES].view(np.int64)
    cap = int(head[H_CAPACITY])
    data = buf[HEADER_BYTES : HEADER_BYTES + cap]
    w = JournalWriter.append_to(journal, payload, valid_bytes=os.path.getsize(journal))
    w.max_bytes = max_bytes
    last: dict[tuple[int, str], tuple[Any, ...]] = {}
    pos, seq = int(head[H_TAIL_POS]), int(head[H_TAIL_SEQ])
    written = 0
    poll = POLL_MIN_S
    try:
        while True:
            got = read_job(data, cap, pos, seq)
            if got is not None and got[0] == "wrap":
                # A wrap word is this lap's only if the job after it is the one due: a stale one
                # from an earlier lap must not move the tail past a job still to come.
                after = read_job(data, cap, got[1], seq)
                got = after if after is not None and after[0] == "job" else None
            if got is not None and got[0] == "job":
                _, jseq, meta, end = got
                if meta.get("x"):
                    # Some of its bytes are outside the ring: the recording process writes it
                    # and then moves the tail on; until then nothing after it may be written.
                    if int(head[H_TAIL_SEQ]) > jseq:
                        pos, seq = int(head[H_TAIL_POS]), int(head[H_TAIL_SEQ])
                        last.clear()  # the payload grew under another writer
                        continue
                elif jseq != seq:
                    raise RuntimeError(f"record ring job {jseq} found where job {seq} was due")
                else:
                    w.refresh_sizes()  # the recording process may have appended (a job outside the ring)
                    frame = build_frame(data, jseq, meta, base=w.payload_size, last=last)
                    if frame is None:
                        raise RuntimeError(f"record ring job {jseq} names bytes that are not in the ring")
                    kind, body, views = frame
                    if views:
                        w.write_payloads(views)
                    w.write_frame(kind, body)
                    pos, seq = end, jseq + 1
                    head[H_TAIL_SEQ] = seq
                    head[H_TAIL_POS] = pos
                    written += 1
                    poll = POLL_MIN_S
                    if kind == FrameKind.CLOSE:
                        return written
                    continue
            if head[H_STOP] or os.getppid() != parent:
                return written
            time.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
    finally:
        w.close()
        del head, data, buf
        try:
            mm.close()
        except BufferError:
            pass


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
