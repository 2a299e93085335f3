"""Getting a job's tensors off the device (and out of the program's hands) with few operations.

Where the bytes land: with a record ring (``replay.record.ring``), in the job's own allocations of
the ring, a shared mapping that outlives the process; without one (no ``/dev/shm``, or CUDA cannot
register it), in pinned buffers of a pool and clones, the path the writer thread waits on.

Small CUDA tensors are packed into one device buffer and copied to the host in one transfer;
large ones are digested on the device and copied only when their bytes are kept; CPU tensors are
copied now (the program may change them once the call returns). Everything is queued on the
current stream; a job's event (and, in the ring, its commit word) says when the copies landed.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay.digest import local_tensor
from replay.format.schema import TensorKind, dtype_to_str
from replay.record.ring import JOB_HEADER_BYTES, RingFull, ShmRing
from replay.record.writer import Entry, Job, PinnedPool

__all__ = ["Staging", "RingJob", "SMALL_BYTES", "job_meta"]

# CUDA tensors up to this size are packed and copied to the host in one transfer per call.
SMALL_BYTES = 64 << 10
# Each job's first allocation: its header and room for a small meta (a note, a graph frame, the
# note that a step was dropped), so that such a job never needs a second allocation.
JOB_RESERVE = 256
META_ROOM = JOB_RESERVE - JOB_HEADER_BYTES


@dataclass(slots=True)
class RingJob:
    """The ring allocations of one job being built (a step between begin and end)."""

    header_at: int  # offset of the job header in the data area
    start: int  # virtual position of the header
    used: int = JOB_RESERVE
    external: bool = False  # some bytes are outside the ring: the step waits for the writer
    dropped: bool = False  # the ring was full (policy "drop"): the job is not recorded
    cuda: Any = None  # the device of the job's CUDA work, if any


# CPU tensors of one call share one ring allocation, each at an offset aligned for any dtype.
_CPU_ALIGN = 16
_DTYPE_STR: dict[torch.dtype, str] = {}


def _dtype_str(dtype: torch.dtype) -> str:
    s = _DTYPE_STR.get(dtype)
    if s is None:
        s = _DTYPE_STR[dtype] = dtype_to_str(dtype)
    return s


def _np_bytes(t: torch.Tensor):  # noqa: ANN202 - a flat uint8 numpy array, or None
    """The tensor's bytes in row-major order as numpy sees them (None: a dtype numpy lacks)."""
    try:
        a = t.numpy()
    except (TypeError, RuntimeError):
        return None  # bfloat16 and friends
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)


@dataclass(slots=True)
class _Commit:
    counter: torch.Tensor
    count: int = 0


class Staging:
    def __init__(self, ring: ShmRing | None = None, *, block: bool = True, timeout: float = 30.0) -> None:
        self.pool = PinnedPool()
        self.ring = ring
        self.block = block
        self.timeout = timeout
        self.cuda_async = True  # False: the ring could not be registered; copies into it block
        self.notes: list[str] = []  # for the recorder to write (registration fallback)
        self._device_digests: dict[Any, torch.Tensor] = {}
        self._commits: dict[Any, _Commit] = {}
        self._checked_cuda = False

    # -- ring ------------------------------------------------------------------------------

    def open_job(self) -> RingJob | None:
        if self.ring is None:
            return None
        try:
            at = self.ring.alloc(JOB_RESERVE, block=self.block, timeout=self.timeout)
        except RingFull:
            return RingJob(header_at=-1, start=-1, dropped=True)
        return RingJob(header_at=at, start=self.ring.head - JOB_RESERVE)

    def open_job_blocking(self) -> RingJob:
        assert self.ring is not None
        at = self.ring.alloc(JOB_RESERVE, block=True, timeout=self.timeout)
        return RingJob(header_at=at, start=self.ring.head - JOB_RESERVE)

    def _place(self, job: RingJob | None, nbytes: int) -> int:
        """Ring offset for ``nbytes`` of ``job``, or -1: outside the ring (pool, or dropped)."""
        ring = self.ring
        if job is None or job.dropped or ring is None:
            return -1
        if job.used + nbytes > ring.capacity // 2:
            job.external = True  # one job may not take over half the ring: it goes to the writer
            return -1
        try:
            at = ring.alloc(nbytes, block=self.block, timeout=self.timeout)
        except RingFull:
            job.dropped = True
            return -1
        job.used += nbytes
        return at

    def _check_cuda(self) -> None:
        if self._checked_cuda or self.ring is None:
            return
        self._checked_cuda = True
        why = self.ring.register_cuda()
        if why is not None:
            self.cuda_async = False
            self.notes.append(f"the record ring could not be registered with CUDA ({why}): device copies into it block")

    def _ring_view(self, at: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        assert self.ring is not None
        return self.ring.torch_data()[at : at + nbytes].view(dtype).view(shape)

    # -- tensors ---------------------------------------------------------------------------

    def entries(self, job: RingJob | None, device: list[torch.Tensor] | None,
                items: list[tuple[str, TensorKind, torch.Tensor, bool]]) -> list[Entry]:
        """Capture several tensors now, with as few device operations and ring allocations as
        possible: one allocation for the CPU tensors of the call, one transfer for its small CUDA
        tensors."""
        out: list[Entry] = []
        small: list[tuple[Entry, torch.Tensor]] = []
        small_bytes = 0
        cpu: list[tuple[Entry, torch.Tensor, int, int]] = []  # entry, tensor, bytes, offset in the call's room
        cpu_bytes = 0
        for name, kind, t, store in items:
            t = local_tensor(t).detach()  # a DTensor: this rank's shard
            nbytes = t.numel() * t.element_size()
            e = Entry(name=name, kind=kind, dtype=_dtype_str(t.dtype), shape=tuple(t.shape), store=store)
            out.append(e)
            if t.device.type != "cuda":
                cpu.append((e, t, nbytes, cpu_bytes))
                cpu_bytes += (nbytes + _CPU_ALIGN - 1) & ~(_CPU_ALIGN - 1)
                continue
            if nbytes <= SMALL_BYTES:
                small.append((e, t))
                small_bytes += nbytes
                continue
            if device is not None:
                e.digest_slot = len(device)
                device.append(t)
            if store or device is None:
                self.copy_out(job, e, t, nbytes)
        if cpu:
            self._copy_cpu(job, cpu, cpu_bytes)
        if small:
            self._copy_small(job, small, small_bytes)
        return out

    def _copy_cpu(self, job: RingJob | None, cpu: list[tuple[Entry, torch.Tensor, int, int]], total: int) -> None:
        """CPU tensors into one room of the ring (the program may change them once the call
        returns), or cloned when the ring has no room for them."""
        base = self._place(job, total) if total else -1
        data = self.ring.data if self.ring is not None else None
        for e, t, nbytes, off in cpu:
            if base < 0 or data is None:
                e.host = t.clone()
                continue
            at = base + off
            src = _np_bytes(t)
            if src is not None:
                # numpy's copy costs far less per call than torch views of the ring.
                dst = data[at : at + nbytes]
                dst[...] = src
                e.npv = dst
            else:
                e.host = self._ring_view(at, t.dtype, e.shape, nbytes)
                e.host.copy_(t)
            e.ring_at = at

    def _copy_small(self, job: RingJob | None, small: list[tuple[Entry, torch.Tensor]], small_bytes: int) -> None:
        """Small CUDA tensors packed on the device and copied to the host in one transfer."""
        flat = [t.reshape(-1).view(torch.uint8) for _, t in small]
        packed = flat[0] if len(flat) == 1 else torch.cat(flat)
        host, at = self._host_for(job, torch.uint8, (small_bytes,), small_bytes)
        host.copy_(packed, non_blocking=self.cuda_async)
        if job is not None:
            job.cuda = packed.device
        off = 0
        for (e, _), f in zip(small, flat):
            e.packed = (host, off, f.numel())
            if at >= 0:
                e.ring_at = at + off
            off += f.numel()
        if at < 0:
            small[0][0].release = self._last_buf

    def _host_for(self, job: RingJob | None, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> tuple[torch.Tensor, int]:
        """A host destination for a device copy: in the ring (offset >= 0) or a pinned buffer."""
        if job is not None:
            if job.cuda is None:
                self._check_cuda()
            at = self._place(job, nbytes)
            if at >= 0:
                return self._ring_view(at, dtype, shape, nbytes), at
        host, self._last_buf = self.pool.get(dtype, shape)
        return host, -1

    def copy_out(self, job: RingJob | None, e: Entry, t: torch.Tensor, nbytes: int) -> None:
        host, at = self._host_for(job, t.dtype, tuple(t.shape), nbytes)
        host.copy_(t, non_blocking=self.cuda_async)
        e.host = host
        if at >= 0:
            e.ring_at = at
        else:
            e.release = self._last_buf
        if job is not None:
            job.cuda = t.device

    def stage(self, job: Job, device: list[torch.Tensor] | None, margin: torch.Tensor | None, rjob: RingJob | None = None) -> None:
        """Queue the device work of a job: digests, scalars, and the event the writer waits on."""
        for entries in job.groups.values():
            job.releases.extend(e.release for e in entries if e.release is not None)
        cuda_work = bool(job.releases)
        if device:
            from replay.digest import digest_into

            n = len(device)
            dev = device[0].device
            buf = self._device_digests.get(dev)
            if buf is None or buf.numel() < n:
                buf = self._device_digests[dev] = torch.zeros(max(n, 64), dtype=torch.int64, device=dev)
            for i, t in enumerate(device):
                digest_into(t, buf, i)
            job.digests_host, at = self._pinned_or_ring(job, rjob, buf[:n])
            job.digests_at = at
            cuda_work = True
        if margin is not None:
            job.margin_host, job.margin_at = self._pinned_or_ring(job, rjob, margin)
            cuda_work = True
        if rjob is not None:
            # The event is recorded after the commit word's copy (``seal_job``).
            job.cuda_work = cuda_work or rjob.cuda is not None
        elif cuda_work:
            job.event = torch.cuda.Event()
            job.event.record()

    def _pinned_or_ring(self, job: Job, rjob: RingJob | None, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        nbytes = t.numel() * t.element_size()
        host, at = self._host_for(rjob, t.dtype, tuple(t.shape), nbytes)
        host.copy_(t, non_blocking=self.cuda_async)
        if at < 0:
            job.releases.append(self._last_buf)
        elif rjob is not None:
            rjob.cuda = t.device
        return host, at

    def pinned_copy(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        host, buf = self.pool.get(t.dtype, tuple(t.shape))
        host.copy_(t, non_blocking=True)
        job.releases.append(buf)
        return host

    # -- finishing a ring job --------------------------------------------------------------

    def seal_job(self, job: Job, rjob: RingJob, seq: int, kind: int, meta: dict[str, Any]) -> bool:
        """Write the job's meta and header into the ring; the commit comes last (host or device).
        False: no room for the meta (policy "drop"): the caller records the job as dropped."""
        ring = self.ring
        assert ring is not None
        raw = json.dumps(meta, separators=(",", ":"), allow_nan=True).encode()
        if len(raw) <= META_ROOM:
            at, meta_pos = rjob.header_at + JOB_HEADER_BYTES, rjob.start + JOB_HEADER_BYTES
        else:
            try:
                at = ring.alloc(len(raw), block=self.block, timeout=self.timeout)
            except RingFull:
                return False
            meta_pos = ring.head - ((len(raw) + 63) & ~63)
        ring.data[at : at + len(raw)] = memoryview(raw)
        dev_commit = job.cuda_work
        device = rjob.cuda if isinstance(rjob.cuda, torch.device) else None
        if dev_commit and device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        expected = seq + 1
        if dev_commit:
            c = self._commits.get(device)
            if c is None:
                c = self._commits[device] = _Commit(counter=torch.zeros(1, dtype=torch.int64, device=device))
            c.count += 1
            expected = c.count
        ring.write_job_header(rjob.header_at, kind, seq, meta_pos, len(raw), ring.head, zlib.crc32(raw), dev_commit, expected)
        if dev_commit:
            c.counter.add_(1)
            ring.commit_view(rjob.header_at).copy_(c.counter, non_blocking=self.cuda_async)
            job.event = torch.cuda.Event()
            job.event.record()
        job.ring_end = ring.head
        job.seq = seq
        return True


def job_meta(job: Job, rjob: RingJob) -> dict[str, Any]:
    """What salvage needs to turn a job's ring record into its frame, as the drain would."""
    groups = {}
    external = rjob.external
    for name, entries in job.groups.items():
        rows = []
        for e in entries:
            if e.packed is not None:
                n = e.packed[2]
            elif e.npv is not None:
                n = e.npv.nbytes
            elif e.host is not None:
                n = e.host.numel() * e.host.element_size()
            else:
                n = 0
            if e.ring_at < 0 and e.digest is None and (e.digest_slot < 0 or e.store):
                external = True
            dig = f"{e.digest:016x}" if e.digest is not None else None
            rows.append([e.name, int(e.kind), e.dtype, list(e.shape), bool(e.store), e.ring_at, n, dig, e.digest_slot])
        groups[name] = rows
    meta: dict[str, Any] = {"b": job.body, "g": groups, "f": job.fin}
    if job.digests_at >= 0 and job.digests_host is not None:
        meta["d"] = [job.digests_at, int(job.digests_host.numel())]
    if job.margin_at >= 0:
        meta["m"] = job.margin_at
    if external:
        meta["x"] = 1
    return meta
