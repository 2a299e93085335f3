"""The recorder's writer thread: the only code that does file I/O while a program records.

The step path hands it jobs (tensors already copied to host memory, or pinned buffers with a CUDA
event marking when their copies land). The writer waits for the event, computes the digests that
were not computed on the device, appends payload bytes and then the frame, and acknowledges the
job. Any exception here switches recording off (see ``Recorder._fail``); it never reaches the
program.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import numpy as np

from replay.digest import digest, digest_numpy_many
from replay.format.journal import FrameKind, JournalWriter
from replay.format.schema import TensorKind, TensorRef, dtype_to_str

__all__ = ["Entry", "Job", "Writer", "PinnedPool"]


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
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(dtype).view(shape), buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class Writer:
    """Owns the journal; runs jobs from a bounded queue on a daemon thread."""

    def __init__(self, journal: JournalWriter, *, depth: int, pool: PinnedPool, on_error: Callable[[BaseException], None]) -> None:
        self.journal = journal
        self.pool = pool
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._on_error = on_error
        self._failed = False
        # Payload dedupe: the last stored tensor per (kind, name), reused when its bytes repeat
        # (RNG state, page tables and other inputs that rarely change): no digest, no write.
        self._last: dict[tuple[int, str], tuple[torch.Tensor, int, int]] = {}
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._thread = threading.Thread(target=self._run, name="replay-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job, timeout: float) -> bool:
        if self._failed:
            return False
        try:
            self._q.put(job, timeout=timeout)
            return True
        except queue.Full:
            return False

    def stop(self, timeout: float) -> bool:
        """Finish queued jobs and stop; False if the thread did not end in time."""
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
        while True:
            job = self._q.get()
            if job is None:
                return
            if self._failed:
                self._done(job)
                continue
            try:
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - nothing may escape into the program
                self._failed = True
                self._on_error(e)
            finally:
                self._done(job)

    def _done(self, job: Job) -> None:
        for buf in job.releases:
            self.pool.release(buf)
        job.releases.clear()
        if job.ack is not None:
            job.ack.set()

    def _write(self, job: Job) -> None:
        if job.event is not None:
            job.event.synchronize()
        for entries in job.groups.values():
            for e in entries:
                if e.packed is not None:
                    buf, off, n = e.packed
                    e.host = buf[off : off + n].clone().view(_torch_dtype(e.dtype)).reshape(e.shape)
                    e.packed = None
        slots = job.digests_host.tolist() if job.digests_host is not None else None
        # Payload bytes of the whole job go out in one writev, before the frame that refers to them.
        self._pending = []
        self._pending_bytes = 0
        deduped: dict[int, TensorRef] = {}
        for entries in job.groups.values():
            for e in entries:
                if e.digest is None and e.digest_slot >= 0 and slots is not None:
                    e.digest = slots[e.digest_slot] & 0xFFFFFFFFFFFFFFFF
                elif e.store and e.host is not None and e.digest is None:
                    same = self._same_as_last(e)
                    if same is not None:
                        deduped[id(e)] = same
        self._digest_small(job)
        for name, entries in job.groups.items():
            refs = []
            for e in entries:
                if id(e) in deduped:
                    refs.append(deduped[id(e)].to_json())
                    continue
                if e.digest is None:
                    assert e.host is not None
                    e.digest = digest(e.host)
                ref = TensorRef(name=e.name, dtype=e.dtype, shape=e.shape, digest=e.digest)
                if e.store and e.host is not None:
                    ref = self._store(e, ref)
                refs.append(ref.to_json())
            job.body[name] = refs
        if job.margin_host is not None:
            job.body["margin"] = float(job.margin_host.item())
        if job.finish is not None:
            job.finish(job)
        if self._pending:
            self.journal.write_payloads(self._pending)
            self._pending = []
        self.journal.write_frame(job.kind, job.body)

    def _digest_small(self, job: Job) -> None:
        """Digest a job's small host tensors in one vectorised pass (a per-tensor numpy call costs
        more than the hashing itself for the few-kilobyte tensors a step has)."""
        todo = [
            e
            for entries in job.groups.values()
            for e in entries
            if e.digest is None and e.host is not None and e.host.numel() * e.host.element_size() <= (1 << 18)
        ]
        if len(todo) < 2:
            return
        arrays = [_as_bytes(e.host) for e in todo]  # type: ignore[arg-type]
        for e, d in zip(todo, digest_numpy_many(arrays)):
            e.digest = d

    def _same_as_last(self, e: Entry) -> TensorRef | None:
        last = self._last.get((int(e.kind), e.name))
        if last is None:
            return None
        prev, offset, dig = last
        cur = e.host
        assert cur is not None
        if prev.dtype != cur.dtype or prev.shape != cur.shape or not _bits_equal(prev, cur):
            return None
        e.digest = dig
        return TensorRef(e.name, e.dtype, e.shape, dig, offset, prev.numel() * prev.element_size())

    def _store(self, e: Entry, ref: TensorRef) -> TensorRef:
        assert e.host is not None
        t = e.host.detach().contiguous()
        flat = t.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        offset = self.journal.payload_size + self._pending_bytes
        if nbytes:
            self._pending.append(memoryview(flat.view(torch.uint8).numpy()))
            self._pending_bytes += nbytes
        if nbytes <= (1 << 20):
            # Keep a copy only of small tensors: comparing is then cheaper than digesting.
            self._last[(int(e.kind), e.name)] = (t if e.release is None else t.clone(), offset, ref.digest)
        return TensorRef(ref.name, ref.dtype, ref.shape, ref.digest, offset, nbytes)


def _torch_dtype(name: str) -> torch.dtype:
    from replay.format.schema import str_to_dtype

    return str_to_dtype(name)


def _as_bytes(t: torch.Tensor):  # noqa: ANN202 - numpy array
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def host_entry(name: str, kind: TensorKind, t: torch.Tensor, *, store: bool) -> Entry:
    """An entry for a CPU tensor: cloned now, because the program may change it after the call."""
    t = t.detach()
    return Entry(name=name, kind=kind, dtype=dtype_to_str(t.dtype), shape=tuple(t.shape), host=t.clone(), store=store)
