"""The recorder's writer thread: the only code that does file I/O while a program records.

The step path hands it jobs (tensors already copied to host memory, or pinned buffers with a CUDA
event marking when their copies land). The writer waits for the event, computes the digests that
were not computed on the device, appends payload bytes and then the frame, and acknowledges the
job. Any exception here switches recording off (see ``Recorder._fail``); it never reaches the
program.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import numpy as np

from replay.digest import digest_numpy, digest_numpy_many
from replay.format.journal import FrameKind, JournalWriter
from replay.format.schema import TensorKind, dtype_to_str

__all__ = ["Entry", "Job", "Emitter", "Writer", "PinnedPool", "entry_tensor"]

# How often the ring's drain looks for new jobs when it has none it may write.
POLL_S = 0.002


@dataclass(slots=True)
class Entry:
    """One tensor of a job: host bytes to digest and maybe store, or a digest read off the device."""

    name: str
    kind: TensorKind
    dtype: str
    shape: tuple[int, ...]
    host: torch.Tensor | None = None  # host copy (a clone, or a pinned buffer filled by a D2H copy)
    store: bool = False  # write the bytes to the payload
    digest: int | None = None
    digest_slot: int = -1  # index into the job's device-digest host buffer
    release: Any = None  # pinned buffer to hand back to the pool once written
    packed: Any = None  # (pinned uint8 buffer, offset, nbytes): bytes packed with other small tensors
    device_copy: Any = None  # a device copy (the logits ring), moved to the host only when written
    ring_at: int = -1  # where the bytes lie in the record ring's data area (-1: not in the ring)
    npv: Any = None  # a uint8 numpy view of the bytes in the ring (CPU tensors)


@dataclass(slots=True)
class Job:
    kind: FrameKind
    body: dict[str, Any]
    # Named groups of entries that become lists of tensor refs in the frame body.
    groups: dict[str, list[Entry]] = field(default_factory=dict)
    event: Any = None  # torch.cuda.Event recorded after the job's device work
    digests_host: torch.Tensor | None = None  # pinned int64 buffer of device-computed digests
    margin_host: torch.Tensor | None = None  # pinned float32 scalar, the step's top-2 margin
    finish: Callable[["Job"], None] | None = None  # last touches on the body, after digests are known
    ack: threading.Event | None = None
    releases: list[torch.Tensor] = field(default_factory=list)  # pinned buffers to hand back when done
    # The record ring (``replay.record.ring``): where the job's record ends, its sequence number,
    # where its device digests and margin landed, whether it has device work.
    ring_end: int = -1
    seq: int = -1
    digests_at: int = -1
    margin_at: int = -1
    cuda_work: bool = False
    fin: dict[str, Any] = field(default_factory=dict)  # for salvage: margin, accepted, collectives
    t_hand: float | None = None  # when the drain first saw it (the lag of ring steps)
    side: Any = None  # the side stream's context while a step's device work is being queued
    external: bool = False  # some of its bytes are outside the record ring: a drain process cannot write it


class PinnedPool:
    """Reusable pinned host buffers for device-to-host copies (pinning memory is slow)."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _bucket(nbytes: int) -> int:
        return max(256, 1 << (max(nbytes, 1) - 1).bit_length())

    def get(self, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A pinned view of ``dtype``/``shape`` and the buffer to release afterwards."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        size = self._bucket(nbytes)
        with self._lock:
            lst = self._free.get(size)
            buf = lst.pop() if lst else None
        if buf is None:
            with torch.inference_mode(False):  # reused by steps in and out of inference mode
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(dtype).view(shape), buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class Emitter:
    """Turns a job into its journal frame (payload bytes, then the frame): the writer thread's
    work, and the recording process's own for the jobs a drain process cannot take."""

    def __init__(self, journal: JournalWriter, pool: PinnedPool) -> None:
        self.journal = journal
        self.pool = pool
        # Payload dedupe: the last stored tensor per (kind, name), reused when its bytes repeat
        # (RNG state, page tables and other inputs that rarely change): no digest, no write.
        self._last: dict[tuple[int, str], tuple[str, tuple[int, ...], np.ndarray, int, int]] = {}

    def _done(self, job: Job) -> None:
        for buf in job.releases:
            self.pool.release(buf)
        job.releases.clear()
        if job.ack is not None:
            job.ack.set()

    def _write(self, job: Job) -> None:
        # Everything that does not need the bytes is done before the event wait, while the device
        # is still computing the step; after it only hashing, comparing and one writev are left:
        # that is the time a step waits for in "step" durability.
        plan = self._plan(job)
        if job.event is not None:
            job.event.synchronize()
        self._emit(job, plan)

    def _plan(self, job: Job) -> list[tuple[str, list[tuple[Entry, np.ndarray | None, dict[str, Any]]]]]:
        """Per entry: a uint8 numpy view of its host bytes (None: digested on the device) and
        the frame's tensor ref, still without digest and offset."""
        views: dict[int, np.ndarray] = {}
        plan = []
        for name, entries in job.groups.items():
            items = []
            for e in entries:
                arr = None
                if e.packed is not None:
                    buf, off, n = e.packed
                    whole = views.get(id(buf))
                    if whole is None:
                        whole = views[id(buf)] = buf.numpy()
                    arr = whole[off : off + n]
                elif e.npv is not None:
                    arr = e.npv
                elif e.host is not None:
                    arr = _as_bytes(e.host)
                items.append((e, arr, {"name": e.name, "dtype": e.dtype, "shape": list(e.shape)}))
            plan.append((name, items))
        return plan

    def _emit(self, job: Job, plan: list[tuple[str, list[tuple[Entry, np.ndarray | None, dict[str, Any]]]]]) -> None:
        self._digest_entries(job, plan)
        pending: list[memoryview] = []
        for name, items in plan:
            job.body[name] = [self._ref(e, arr, ref, pending) for e, arr, ref in items]
        if job.margin_host is not None:
            job.body["margin"] = float(job.margin_host.item())
        if job.finish is not None:
            job.finish(job)
        if job.seq >= 0:
            job.body["rs"] = job.seq  # the ring's sequence number: salvage skips what is here
        if pending:
            self.journal.write_payloads(pending)
        self.journal.write_frame(job.kind, job.body)

    def _digest_entries(self, job: Job, plan: list[tuple[str, list[tuple[Entry, np.ndarray | None, dict[str, Any]]]]]) -> None:
        """Every entry's digest: read off the device, taken from the last identical stored copy,
        or computed here (small arrays together, in one vectorised pass)."""
        slots = job.digests_host.tolist() if job.digests_host is not None else None
        small: list[tuple[Entry, np.ndarray]] = []
        for _, items in plan:
            for e, arr, ref in items:
                if e.digest is None and e.digest_slot >= 0 and slots is not None:
                    e.digest = slots[e.digest_slot] & 0xFFFFFFFFFFFFFFFF
                elif arr is None or e.digest is not None:
                    continue
                elif e.store and self._repeat(e, arr, ref):
                    continue
                elif arr.nbytes <= (1 << 18):
                    small.append((e, arr))
                else:
                    e.digest = digest_numpy(arr)
        if small:
            for (e, _), d in zip(small, digest_numpy_many([a for _, a in small])):
                e.digest = d

    def _repeat(self, e: Entry, arr: np.ndarray, ref: dict[str, Any]) -> bool:
        """The same bytes as the last time this tensor was stored: point at them (no digest, no write)."""
        last = self._last.get((int(e.kind), e.name))
        if last is None or last[0] != e.dtype or last[1] != e.shape or not _same_bytes(last[2], arr):
            return False
        e.digest = last[4]
        ref["off"], ref["n"] = last[3], arr.nbytes
        return True

    def _ref(self, e: Entry, arr: np.ndarray | None, ref: dict[str, Any], pending: list[memoryview]) -> dict[str, Any]:
        """The frame's reference to one tensor; its bytes, when stored, join ``pending``."""
        if e.digest is None:
            raise RuntimeError(f"no bytes and no device digest for {e.name!r}")
        ref["dig"] = f"{e.digest:016x}"
        if e.store and arr is not None and "off" not in ref:
            offset = self.journal.payload_size + sum(v.nbytes for v in pending)
            if arr.nbytes:
                pending.append(memoryview(arr))
            ref["off"], ref["n"] = offset, arr.nbytes
            if arr.nbytes <= (1 << 20):
                # Keep the bytes of small tensors only: comparing is cheaper than digesting.
                self._last[(int(e.kind), e.name)] = (e.dtype, e.shape, arr.copy(), offset, e.digest)
        return ref


class Writer(Emitter):
    """Owns the journal; runs jobs from a bounded queue on a daemon thread."""

    def __init__(self, journal: JournalWriter, *, depth: int, pool: PinnedPool, on_error: Callable[[BaseException], None],
                 ring: Any = None, lag_s: float = 0.0) -> None:
        super().__init__(journal, pool)
        # With a record ring the ring bounds what is in flight (its policy: block or drop), so
        # the queue does not: putting a job never waits.
        self.ring = ring
        # How long a ring step may wait for the next one before it is written anyway (0: never).
        self.lag_s = lag_s if ring is not None else 0.0
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._dq: collections.deque[Job | None] = collections.deque()
        self._wake = threading.Event()
        self._on_error = on_error
        self._failed = False
        if ring is not None:
            ring.on_full = self._wake.set  # the step waits for room: write what is there now
        self._thread = threading.Thread(target=self._run, name="replay-writer", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job, timeout: float) -> bool:
        if self._failed:
            return False
        if self.ring is not None:
            # No wake-up per step: a notify hands the interpreter to this thread just as the
            # program goes on with its next step. The drain polls; a job someone waits for
            # (the end marker, a job outside the ring) wakes it.
            self._dq.append(job)
            if job.ack is not None or job.ring_end < 0:
                self._wake.set()
            return True
        try:
            self._q.put(job, timeout=timeout)
            return True
        except queue.Full:
            return False

    def barrier(self, timeout: float) -> bool:
        """Wait until every job handed over so far is written; False on timeout."""
        ev = threading.Event()
        if self.ring is not None:
            self._dq.append(ev)  # type: ignore[arg-type]
            self._wake.set()
        else:
            try:
                self._q.put(ev, timeout=timeout)  # type: ignore[arg-type]
            except queue.Full:
                return False
        return ev.wait(timeout)

    def stop(self, timeout: float) -> bool:
        """Finish queued jobs and stop; False if the thread did not end in time."""
        if self.ring is not None:
            self._dq.append(None)
            self._wake.set()
            self._thread.join(timeout)
            return not self._thread.is_alive()
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return self._failed

    def _run(self) -> None:
        if self.ring is not None:
            self._run_ring()
            return
        while True:
            job = self._q.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            self._one(job)

    def _run_ring(self) -> None:
        """Drain the ring's jobs in order. A step is written once the next job has been handed
        over (the program is then usually waiting on the device) or ``lag_s`` after it came."""
        dq = self._dq
        while True:
            if not dq:
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            job = dq[0]
            if job is None:
                dq.popleft()
                return
            if isinstance(job, threading.Event):  # a barrier: everything before it is written
                dq.popleft()
                job.set()
                continue
            if len(dq) == 1 and self.lag_s and job.kind == FrameKind.STEP and job.ack is None and not self.ring.waiting:
                if job.t_hand is None:
                    job.t_hand = time.monotonic()
                elif time.monotonic() - job.t_hand >= self.lag_s:
                    dq.popleft()
                    self._one(job)
                    continue
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            dq.popleft()
            self._one(job)

    def _one(self, job: Job) -> None:
        if self._failed:
            self._done(job)
            return
        try:
            self._write(job)
            if job.ring_end >= 0:
                # The job is in the journal: its room in the ring can be reused.
                self.ring.release(job.ring_end, job.seq + 1)
        except BaseException as e:  # noqa: BLE001 - nothing may escape into the program
            self._failed = True
            self._on_error(e)
        finally:
            self._done(job)

def _torch_dtype(name: str) -> torch.dtype:
    from replay.format.schema import str_to_dtype

    return str_to_dtype(name)


def _as_bytes(t: torch.Tensor):  # noqa: ANN202 - numpy array
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def entry_tensor(e: Entry) -> torch.Tensor | None:
    """An entry's bytes as a host tensor, once its copy has landed (in a job's ``finish``).

    Bytes packed with other small tensors are copied out: their offset in the shared buffer need
    not suit the dtype, and the buffer is reused once the job is written."""
    if e.host is not None:
        return e.host
    if e.packed is None:
        return None
    buf, off, n = e.packed
    return buf[off : off + n].clone().view(_torch_dtype(e.dtype)).reshape(e.shape)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.nbytes != b.nbytes:
        return False
    # Small buffers compare fastest as bytes; larger ones without the copies.
    return a.tobytes() == b.tobytes() if a.nbytes <= (64 << 10) else bool(np.array_equal(a, b))


def host_entry(name: str, kind: TensorKind, t: torch.Tensor, *, store: bool) -> Entry:
    """An entry for a CPU tensor: cloned now, because the program may change it after the call."""
    t = t.detach()
    return Entry(name=name, kind=kind, dtype=dtype_to_str(t.dtype), shape=tuple(t.shape), host=t.clone(), store=store)
