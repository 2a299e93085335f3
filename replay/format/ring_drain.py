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

from replay.format.journal import FrameKind, JournalWriter, encode_frames
from replay.format.ring_salvage import (
    H_CAPACITY,
    H_STOP,
    H_TAIL_POS,
    H_TAIL_SEQ,
    H_WAITING,
    H_WAKEABLE,
    HEADER_BYTES,
    build_frame,
    read_job,
)

__all__ = ["run_drain", "child_main"]

# Pacing. The drain's CPU time is taken from the program on a host whose cores the program's
# threads fill (a CPU decode step with intra-op threads), and each of its wake-ups costs CPU of
# its own (the sleep's timer and wake-up), the first job after it with cold caches
# (``benchmarks/diag/drain_cpu.py``: 0.9-1.5 ms of drain CPU a step, 9-45 sleeps a job, when it
# looked every 50 µs..1 ms; 0.3-0.65 ms and 0.3 sleeps a job since). So it takes whatever is whole in one go
# and sleeps longer while its wake-ups find little (up to POLL_MAX_S), shorter when one finds more
# than an eighth of the ring. The recording process cuts a sleep short (WAKE_SIGNAL) when it
# waits: for room, for a job to be written, or for the drain to end. A record waits in the ring
# (shared memory, salvaged if the rank is killed) for at most POLL_MAX_S before it is written.
POLL_MIN_S = 0.00005
POLL_MAX_S = 0.025
WAKE_SIGNAL = signal.SIGUSR1
# Jobs written together (payloads in one call, frames in one): at most this many, or an eighth of
# the ring's bytes.
BATCH_JOBS = 64


def next_poll(poll: float, drained: int, capacity: int) -> float:
    """The next sleep after a wake-up that wrote ``drained`` payload bytes."""
    if drained > capacity // 8:
        return max(POLL_MIN_S, poll / 4)
    return min(POLL_MAX_S, poll * 2)


class _OverBudget(Exception):
    """A batch that would pass the size limit: its jobs are written one by one up to it."""


class _Drain:
    """The ring (mapped shared, read and write: the drain moves the tail words) and the journal."""

    def __init__(self, ring_path: Path, journal: Path, payload: Path, max_bytes: int | None, *, wakeable: bool = False) -> None:
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
        # Woken early by WAKE_SIGNAL only where every thread blocks it (``run_drain``).
        self.wakeable = wakeable and hasattr(signal, "sigtimedwait") and WAKE_SIGNAL in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        if self.wakeable:
            self.head[H_WAKEABLE] = 1
        self.stats = {"jobs": 0, "bytes": 0, "frame_s": 0.0, "write_s": 0.0, "sleep_s": 0.0, "sleeps": 0}
        # Jobs taken and not yet written (``flush``): kind, body, payload views, end, next seq;
        # their payload bytes, and where the next job's payload goes.
        self.pending: list[tuple[Any, ...]] = []
        self.pending_bytes = 0
        self.base = 0

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
        """Make a whole job's frame, written with the others taken in this go by ``flush``;
        None when it is the recording process's to write (bytes outside the ring) and that
        process has not moved the tail past it yet."""
        _, jseq, meta, end = got
        if meta.get("x"):
            self.flush()  # that process waits for the tail to reach this job
            seq = int(self.head[H_TAIL_SEQ])
            if seq > jseq:  # written by the recording process, which stored the position before
                self.pos, self.seq = int(self.head[H_TAIL_POS]), seq
                self.last.clear()  # the payload grew under another writer
            return None
        if jseq != self.seq:
            raise RuntimeError(f"record ring job {jseq} found where job {self.seq} was due")
        t0 = time.perf_counter()
        if not self.pending:
            self.w.refresh_sizes()  # the recording process may have appended (a job outside the ring)
            self.base = self.w.payload_size
        frame = build_frame(self.data, jseq, meta, base=self.base, last=self.last)
        if frame is None:
            raise RuntimeError(f"record ring job {jseq} names bytes that are not in the ring")
        kind, body, views = frame
        nbytes = sum(v.nbytes for v in views)
        self.pending.append((kind, body, views, end, jseq + 1))
        self.base += nbytes
        self.pending_bytes += nbytes
        self.stats["frame_s"] += time.perf_counter() - t0
        self.pos, self.seq = end, jseq + 1
        if len(self.pending) >= BATCH_JOBS or self.pending_bytes >= self.cap // 8 or kind == FrameKind.CLOSE:
            self.flush()
        return kind

    def flush(self) -> None:
        """Write the jobs taken (their payloads in one call, then their frames in one), then
        move the ring's tail past them. When that fails (a full disk, the size limit), as many
        whole jobs as fit are written one by one, in order, before the error goes on."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        pending, self.pending = self.pending, []
        payloads_written = False
        try:
            frames = encode_frames([(kind, body) for kind, body, *_ in pending])
            views = [v for job in pending for v in job[2]]
            if not self.w.fits(self.pending_bytes + len(frames)):
                raise _OverBudget
            if views:
                self.w.write_payloads(views)
            payloads_written = True
            self.w.write_encoded(frames)
        except (OSError, _OverBudget):
            # Written one by one up to the job that does not fit (its error goes on from there).
            self._one_by_one(pending, payloads_written)
            return
        self._done(pending[-1], len(pending), self.pending_bytes, t0)

    def _one_by_one(self, pending: list[tuple[Any, ...]], payloads_written: bool) -> None:
        """After a failed batch: each job's payload (unless the batch's were written, at the
        offsets its frames name) and frame, until one fails (its error goes on)."""
        for kind, body, views, end, seq in pending:
            t0 = time.perf_counter()
            if views and not payloads_written:
                self.w.write_payloads(views)
            self.w.write_frame(kind, body)
            self._done((kind, body, views, end, seq), 1, sum(v.nbytes for v in views), t0)

    def _done(self, last: tuple[Any, ...], jobs: int, nbytes: int, t0: float) -> None:
        """Jobs up to ``last`` are in the journal: the tail moves past them."""
        st = self.stats
        st["write_s"] += time.perf_counter() - t0
        st["jobs"] += jobs
        st["bytes"] += nbytes
        self.pending_bytes = 0
        _, _, _, end, seq = last
        self.head[H_TAIL_POS] = end  # (the position first, as ShmRing.release)
        self.head[H_TAIL_SEQ] = seq

    def sleep(self, poll: float) -> None:
        t0 = time.perf_counter()
        if self.wakeable:
            signal.sigtimedwait((WAKE_SIGNAL,), poll)
        else:
            time.sleep(poll)
        self.stats["sleep_s"] += time.perf_counter() - t0
        self.stats["sleeps"] += 1

    def close(self) -> None:
        self.w.close()  # (frames taken and not flushed stay in the ring, for salvage)
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


def run_drain(ring_path: Path, journal: Path, payload: Path, *, parent: int, max_bytes: int | None = None,
              wakeable: bool = False) -> int:
    """Drain until the end marker, a stop request or the parent's death; returns jobs written.
    ``wakeable``: WAKE_SIGNAL was blocked in every thread of this process (the drain process's
    first statement does it), so the recording process may send it."""
    d = _Drain(ring_path, journal, payload, max_bytes, wakeable=wakeable)
    poll = POLL_MIN_S
    try:
        while True:
            drained = d.stats["bytes"]
            while True:  # every job that is whole now
                got = d.next_job()
                kind = d.take(got) if got is not None and got[0] == "job" else None
                if kind == FrameKind.CLOSE:
                    return d.stats["jobs"]
                if kind is None and not (got is not None and got[0] == "job" and d.seq > got[1]):
                    break  # (a job the recording process wrote moved the tail: go on from there)
            d.flush()
            if d.head[H_STOP] or os.getppid() != parent:
                return d.stats["jobs"]
            poll = POLL_MIN_S if d.head[H_WAITING] else next_poll(poll, d.stats["bytes"] - drained, d.cap)
            d.sleep(poll)
    finally:
        d.close()


# How the drain process is scheduled beside the program (``REPLAY_DRAIN_SCHED``, a development
# setting for ``benchmarks/diag/drain_priority.py``): "normal" (as the program), "batch"
# (``SCHED_BATCH``: its wake-ups do not preempt the program's threads), "idle" (``SCHED_IDLE``: it
# runs only on a core nothing else wants) or "nice" (nice 19).
DRAIN_SCHED = "normal"


def lower_priority(how: str) -> str | None:
    """Schedule this process as ``how`` says; None, or why it could not (not Linux, refused)."""
    try:
        if how == "batch":
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        elif how == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif how == "nice":
            os.nice(19)
        elif how != "normal":
            return f"unknown drain scheduling {how!r}"
    except (AttributeError, OSError) as e:
        return f"{e.__class__.__name__}: {e}"
    return None


def child_main(argv: list[str]) -> int:
    """The drain process's entry: one JSON argument (ring, journal, payload, parent, max_bytes).
    Exit 0 when done; 3 with one line on standard error when it failed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the program, which closes the recording
    lower_priority(os.environ.get("REPLAY_DRAIN_SCHED") or DRAIN_SCHED)
    a = json.loads(argv[0])
    try:
        run_drain(Path(a["ring"]), Path(a["journal"]), Path(a["payload"]), parent=int(a["parent"]), max_bytes=a.get("max_bytes"),
                  wakeable=bool(a.get("wakeable")))
    except BaseException as e:  # noqa: BLE001 - one line for the recording process, never a traceback
        sys.stderr.write(f"{e.__class__.__name__}: {e}\n")
        return 3
    return 0
