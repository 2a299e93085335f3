"""Getting a job's tensors off the device (and out of the program's hands) with few operations.

Where the bytes land: with a record ring (``replay.record.ring``), in the job's own allocations of
the ring, a shared mapping that outlives the process; without one (no ``/dev/shm``, or CUDA cannot
register it), in pinned buffers of a pool and clones, the path the writer thread waits on.

Small CUDA tensors are packed into one device buffer and copied to the host in one transfer;
large ones are digested on the device and copied only when their bytes are kept; CPU tensors are
copied now (the program may change them once the call returns). A job's event (and, in the ring,
its commit word) says when the copies landed.

A step's CUDA record work runs on a side stream (``Staging.defer``): on the program's stream the
step queues only snapshots (one packing kernel for the small tensors of a call, one device copy
of each large one), then the side stream, ordered after them by an event, digests, computes the
margin, copies into the ring and writes the commit word. The program's own sync (the tokens it
reads back) then waits for its step and the snapshots, not for the record, and the host queues
the side work after the step's kernels, while the device runs them.
"""

from __future__ import annotations

import ctypes
import inspect
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from replay.digest import local_tensor
from replay.format.schema import TensorKind, dtype_to_str
from replay.record.job_meta import MetaText
from replay.record.ring import COMMIT_OFFSET, JOB_HEADER_BYTES, RingFull, ShmRing
from replay.record.side_plan import SidePlans
from replay.record.stream_write import StreamWriter, open_stream_writer
from replay.record.writer import Entry, Job, PinnedPool

__all__ = ["Staging", "RingJob", "SMALL_BYTES", "dtype_str"]

# CUDA tensors up to this size are packed and copied to the host in one transfer per call.
SMALL_BYTES = 64 << 10
# At most this many snapshot buffers are kept (shapes of the steps' large tensors, per place in
# a step), holding at most this many bytes of device memory together (the program's memory is
# not ours to take: a large vocabulary's logits times many batch shapes would be gigabytes);
# beyond, snapshots are fresh copies and the side work runs without a graph.
MAX_STATIC = 64
MAX_STATIC_BYTES = 256 << 20
# Each job's first allocation: its header and room for a small meta (a note, a graph frame, the
# note that a step was dropped), so that such a job never needs a second allocation.
JOB_RESERVE = 256
META_ROOM = JOB_RESERVE - JOB_HEADER_BYTES

_current_stream_raw = getattr(torch._C, "_cuda_getCurrentStream", None)
# The side stream is entered and left once a step, on the program's thread: through the C
# functions under ``torch.cuda.stream`` and ``Event.record`` (their Python layers ask for the
# current stream again, build a context and check the device: tens of µs a step on the host).
_set_stream_raw = getattr(torch._C, "_cuda_setStream", None)
_current_device_raw = getattr(torch._C, "_cuda_getDevice", None)


def _c_method(cls: type, name: str) -> Any:
    """The C implementation under a Python override of ``cls.name`` (None: there is none)."""
    for base in cls.__mro__[1:]:
        f = base.__dict__.get(name)
        if f is not None:
            return None if inspect.isfunction(f) else f
    return None


_event_record_c = _c_method(torch.cuda.Event, "record")
_event_wait_c = _c_method(torch.cuda.Event, "wait")
_RAW_STREAMS = None not in (_current_stream_raw, _set_stream_raw, _current_device_raw)


def _stream_id(t: torch.Tensor) -> Any:
    """The current stream of ``t``'s device, as a hashable id, without making a Stream object."""
    if _current_stream_raw is not None:
        return _current_stream_raw(t.get_device())  # (stream id, device index, device type)
    return torch.cuda.current_stream(t.device)



@dataclass(slots=True)
class RingJob:
    """The ring allocations of one job being built (a step between begin and end)."""

    header_at: int  # offset of the job header in the data area
    start: int  # virtual position of the header
    used: int = JOB_RESERVE
    external: bool = False  # some bytes are outside the ring: the step waits for the writer
    dropped: bool = False  # the ring was full (policy "drop"): the job is not recorded
    cuda: Any = None  # the device of the job's CUDA work, if any


# A step's area (its small CUDA tensors, packed): its smallest and largest size, and how many
# places in a step (offset and signature of a call's tensors) keep their views.
AREA_MIN = 64 << 10
AREA_MAX = 16 << 20
MAX_AREA_PLANS = 256
# CPU tensors of one call share one ring allocation, each at an offset aligned for any dtype.
_CPU_ALIGN = 16
_DTYPE_STR: dict[torch.dtype, str] = {}


def dtype_str(dtype: torch.dtype) -> str:
    s = _DTYPE_STR.get(dtype)
    if s is None:
        s = _DTYPE_STR[dtype] = dtype_to_str(dtype)
    return s


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's bytes as a flat uint8 tensor, in row-major order of its values."""
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError:
        # A strided 1-D view, a lazy conjugate or negation: the values made dense first.
        return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


# Dtypes whose tensors hold their values as plain bytes (not complex: a lazy conjugate; not
# quantized: scales beside the bytes).
_PLAIN_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, *(getattr(torch, n) for n in (
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)),
})
_memmove = ctypes.memmove


def _plain_bytes(t: torch.Tensor) -> bool:
    """Whether a tensor's bytes, from ``data_ptr`` on, are its values in row-major order: a plain
    dense CPU tensor (not a subclass, a lazy negation, a meta or a strided view)."""
    return (type(t) is torch.Tensor and t.is_cpu and t.dtype in _PLAIN_DTYPES and t.layout is torch.strided
            and t.is_contiguous() and not t.is_neg())


def _np_bytes(t: torch.Tensor):  # noqa: ANN202 - a flat uint8 numpy array, or None
    """The tensor's bytes in row-major order as numpy sees them (None: a dtype numpy lacks)."""
    try:
        a = t.numpy()
    except (TypeError, RuntimeError):
        return None  # bfloat16 and friends
    # ascontiguousarray: reshape(-1) of a strided 1-D view is still strided (no byte view of it).
    return np.ascontiguousarray(a.reshape(-1)).view(np.uint8) if a.size else np.zeros(0, np.uint8)


class _StreamObjects:
    """``torch.cuda.Stream`` objects of the streams the program makes current, one per raw id
    (a Stream object is only its id; making one a step costs more than the work it orders)."""

    MAX = 64

    def __init__(self) -> None:
        self._objs: dict[tuple, Any] = {}

    def current(self, dev: torch.device) -> Any:
        if not _RAW_STREAMS:
            return torch.cuda.current_stream(dev)
        raw = _current_stream_raw(dev.index)  # type: ignore[misc]
        s = self._objs.get(raw)
        if s is None:
            if len(self._objs) >= self.MAX:
                self._objs.clear()
            s = self._objs[raw] = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
        return s


def _record(event: Any, stream: Any) -> None:
    """``event.record(stream)``, without the Python layer's second look at the current stream."""
    if _event_record_c is not None:
        _event_record_c(event, stream)
    else:
        event.record(stream)


def _wait(stream: Any, event: Any) -> None:
    """``stream.wait_event(event)``: work queued later on ``stream`` waits for ``event``."""
    if _event_wait_c is not None:
        _event_wait_c(event, stream)
    else:
        stream.wait_event(event)


@dataclass(slots=True)
class _Side:
    """The side stream entered for one job: what ``leave_side`` restores."""

    stream: Any
    dev: torch.device
    program: Any  # the program's stream object
    ctx: Any = None  # a ``torch.cuda.stream`` context, when the raw switch was not used


@dataclass(slots=True)
class _Commit:
    """A device's commit words: the count of its jobs committed by the device, and how the
    word is written (the driver's stream write at ``ring_base``, or ``counter`` and a copy)."""

    counter: torch.Tensor
    count: int = 0
    writer: StreamWriter | None = None
    ring_base: int = 0  # the device address of the ring's data area
    writer_tried: bool = False  # the stream writer was asked for (``Staging.driver_commit``)


class Staging:
    # Defaults of each recorder's staging (class attributes so that a benchmark can compare).
    DEFER = True  # a step's CUDA record work on the side stream
    STATIC_SNAPSHOTS = True  # snapshots in kept buffers, so the side work can be a graph
    AREA = True  # a step's small CUDA tensors packed into one kept buffer (else by ``cat``, a call)
    # Commit words written by the driver's stream write (else a device counter and a copy). Off:
    # side by side it measured no faster (bench_record.py --ab), and it has had less of the GPU
    # suite behind it (benchmarks/RESULTS.md, 2026-12-06).
    DRIVER_COMMIT = False

    def __init__(self, ring: ShmRing | None = None, *, block: bool = True, timeout: float = 30.0) -> None:
        self.pool = PinnedPool()
        self.meta_text = MetaText()
        self.ring = ring
        # Where the ring's data area lies: CPU tensors are copied there. A copy holds a view of
        # the area meanwhile (``_copy_cpu``'s ``data``), so a close of the ring in between
        # cannot unmap it (``ShmRing.close`` leaves a mapping with views to the process).
        self._ring_address = ring.data.ctypes.data if ring is not None else 0
        self.block = block
        self.timeout = timeout
        self.cuda_async = True  # False: the ring could not be registered; copies into it block
        self.notes: list[str] = []  # for the recorder to write (registration fallback)
        self._device_digests: dict[Any, torch.Tensor] = {}
        self._commits: dict[Any, _Commit] = {}
        self._checked_cuda = False
        # The side stream (``defer``): the open step's device work waiting for it, the snapshots
        # it reads, and one snapshot per tensor of the step (the logits are digested, kept for
        # the logits ring and give the margin: one copy serves all three).
        self.defer = self.DEFER
        self._side: dict[Any, Any] = {}
        self._later: list[Any] = []
        self._snaps: dict[tuple, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor | None, int]] = []  # snapshots not yet given ring room
        self.static_snapshots = self.STATIC_SNAPSHOTS
        self._static: dict[tuple, torch.Tensor] = {}  # snapshot buffers kept from step to step
        self._input_static: dict[tuple, tuple[list[torch.Tensor], bool]] = {}  # per argument signature: buffers, any large
        self._static_ids: set[int] = set()  # ids of the kept buffers (never freed while kept)
        self._static_bytes = 0
        self._side_done: dict[Any, Any] = {}  # per device: the event after the last step's side work
        self._ring_copies: list[tuple[Entry, torch.Tensor]] = []
        self.plans = SidePlans()
        self._streams = _StreamObjects()
        self._order_events: dict[Any, Any] = {}  # per device: the event the side stream waits on
        # The open step's small CUDA tensors, packed into one kept device buffer (its "area")
        # with one ``_foreach_copy_`` a call, and copied into the ring with one copy a step.
        self.area = self.AREA
        self.driver_commit = self.DRIVER_COMMIT
        self._areas: dict[Any, torch.Tensor] = {}  # per device
        self._area_plans: dict[tuple, tuple[list[torch.Tensor], list[int], int] | None] = {}
        self._area_dev: Any = None  # the device of the open step's area (one a step)
        self._area_used = 0
        self._area_entries: list[tuple[Entry, int, int]] = []  # entry, offset in the area, bytes
        self._area_want: dict[Any, int] = {}  # per device: bytes a step needed where its area was too small

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
        flat = self.ring.torch_data()[at : at + nbytes]
        if dtype is torch.uint8 and len(shape) == 1:
            return flat  # packed bytes: already what the copy writes into
        return flat.view(dtype).view(shape)

    # -- tensors ---------------------------------------------------------------------------

    def entries(self, job: RingJob | None, device: list[torch.Tensor] | None,
                items: list[tuple[str, TensorKind, torch.Tensor, bool]], *, step: bool = False) -> list[Entry]:
        """Capture several tensors now, with as few device operations and ring allocations as
        possible: one allocation for the CPU tensors of the call, one transfer for its small CUDA
        tensors. ``step``: tensors of an open step, whose device work may go to the side stream
        (``stage`` runs it)."""
        later = step and self.defer
        out: list[Entry] = []
        small: list[tuple[Entry, torch.Tensor]] = []
        small_bytes = 0
        cpu: list[tuple[Entry, torch.Tensor, int, int]] = []  # entry, tensor, bytes, offset in the call's room
        cpu_bytes = 0
        for name, kind, t, store in items:
            if type(t) is not torch.Tensor:
                t = local_tensor(t)  # a DTensor: this rank's shard
            if t.requires_grad:  # no autograd history for the recorder's copies (detach is a torch call a tensor)
                t = t.detach()
            nbytes = t.nbytes
            e = Entry(name=name, kind=kind, dtype=dtype_str(t.dtype), shape=tuple(t.shape), store=store)
            out.append(e)
            if not t.is_cuda:
                cpu.append((e, t, nbytes, cpu_bytes))
                cpu_bytes += (nbytes + _CPU_ALIGN - 1) & ~(_CPU_ALIGN - 1)
                continue
            if nbytes <= SMALL_BYTES:
                small.append((e, t))
                small_bytes += nbytes
                continue
            if later:
                t = self.snapshot(t)
            if device is not None:
                e.digest_slot = len(device)
                device.append(t)
            if later and (store or device is None):
                self._pending.append(((e, t), None, nbytes))
            elif store or device is None:
                self.copy_out(job, e, t, nbytes)
        if cpu:
            self._copy_cpu(job, cpu, cpu_bytes)
        if small:
            self._small(job, small, small_bytes, later)
        return out

    def _small(self, job: RingJob | None, small: list[tuple[Entry, torch.Tensor]], small_bytes: int, later: bool) -> None:
        """A call's small CUDA tensors: packed now on the program's stream; with ``later``, the
        room in the ring and the copy into it come at the step's end (``place_pending``), after
        the step was queued."""
        if not later:
            self._copy_small(job, small, small_bytes)
        elif not (self.area and self._pack_into_area(small)):
            flat = [_flat_bytes(t) for _, t in small]
            packed = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            self._pending.append((small, packed, small_bytes))

    # -- the step's area: its small CUDA tensors in one kept buffer ---------------------------

    def _pack_into_area(self, small: list[tuple[Entry, torch.Tensor]]) -> bool:
        """Copy a call's small CUDA tensors into the open step's area with one launch, at views
        made once for that place in the step and that signature (no view, reshape or ``cat`` of
        each tensor a step). False: not packed here (another device than the step's area, an
        area too small until the step's end, a tensor the views cannot hold): the caller packs."""
        srcs = [t for _, t in small]
        key = (self._area_used, *((t.shape, t.dtype, t.get_device()) for t in srcs))
        plan = self._area_plans.get(key, False)
        if plan is False:
            plan = self._area_plan(key, srcs)
        if plan is None:
            return False
        dsts, offsets, end = plan
        dev = srcs[0].device
        if self._area_dev is None:
            self._area_dev = dev
            self._wait_side(dev)  # the last step's copy out of the area comes first
        elif self._area_dev != dev:
            return False
        try:
            torch._foreach_copy_(dsts, srcs)
        except RuntimeError:
            self._area_plans[key] = None  # a tensor _foreach_copy_ cannot take: packed by cat
            return False
        for (e, t), off in zip(small, offsets):
            self._area_entries.append((e, off, t.numel() * t.element_size()))
        self._area_used = end
        return True

    def _area_plan(self, key: tuple, srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], int] | None:
        """The area's views for one call's small tensors at the area's current end (None: they
        do not fit; the area grows at the step's end)."""
        if len(self._area_plans) >= MAX_AREA_PLANS:
            self._area_plans.clear()
        dev = srcs[0].device
        off, offsets, sizes = self._area_used, [], []
        for t in srcs:
            if t.get_device() != dev.index or t.layout != torch.strided or t.is_quantized:
                self._area_plans[key] = None
                return None
            off = (off + _CPU_ALIGN - 1) & ~(_CPU_ALIGN - 1)
            n = t.numel() * t.element_size()
            offsets.append(off)
            sizes.append(n)
            off += n
        area = self._areas.get(dev)
        if area is None or area.numel() < off:
            self._area_want[dev] = max(self._area_want.get(dev, 0), off)
            return None  # not cached: this place fits once the area has grown
        with _normal_tensors():  # views made in inference mode could not be written outside it
            dsts = [area[o : o + n].view(t.dtype).view(t.shape) for t, o, n in zip(srcs, offsets, sizes)]
        plan = self._area_plans[key] = (dsts, offsets, off)
        return plan

    def _place_area(self, job: RingJob | None) -> None:
        """The step's end: room in the ring for the used part of the area; its copy into the
        ring is queued by ``stage`` on the side stream, after the step's work."""
        entries, used, dev = self._area_entries, self._area_used, self._area_dev
        self._area_entries, self._area_used, self._area_dev = [], 0, None
        if entries:
            area = self._areas[dev]
            host, at = self._host_for(job, torch.uint8, (used,), used)
            self._defer(area, (host, area[:used]))  # a grown area's old buffer is kept until then
        if self._area_want:
            self._grow_areas()
        if not entries:
            return
        if job is not None:
            job.cuda = dev
        for e, off, n in entries:
            e.packed = (host, off, n)
            if at >= 0:
                e.ring_at = at + off
        if at < 0:
            entries[0][0].release = self._last_buf

    def _grow_areas(self) -> None:
        """Larger areas for the next steps, where the last one was too small (the old one is
        freed once the side stream has read it); none beyond ``AREA_MAX``: packed by ``cat``."""
        want, self._area_want = self._area_want, {}
        for dev, nbytes in want.items():
            size = max(AREA_MIN, 1 << (nbytes - 1).bit_length())
            old = self._areas.get(dev)
            if size > AREA_MAX or (old is not None and old.numel() >= size):
                continue
            self._area_plans.clear()  # their views are of the old area
            if old is not None:
                side = self._side.get(dev)
                if side is not None:
                    old.record_stream(side)
                self._static_ids.discard(id(old))
            with _normal_tensors():
                area = self._areas[dev] = torch.empty(size, dtype=torch.uint8, device=dev)
            self._static_ids.add(id(area))

    # -- the side stream -------------------------------------------------------------------

    def snapshot(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of ``t`` as it is now in the program's stream, one per tensor a step.

        The copy goes into a buffer kept for that place in the step (its n-th snapshot, of that
        shape and dtype), so that the side stream's work reads the same addresses every step and
        can be replayed as a graph (``replay.record.side_plan``); the program's stream first waits
        for the side stream's last reads of those buffers (queued on the device, not the host)."""
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        snap = self._snaps.get(key)
        if snap is not None:
            return snap
        skey = (len(self._snaps), key[1], t.dtype, t.device)
        buf = self._static.get(skey)
        if buf is None and self.static_snapshots and self._may_keep(t.numel() * t.element_size()):
            with _normal_tensors():
                buf = self._static[skey] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self._static_ids.add(id(buf))
        if buf is None:
            snap = t.detach().clone()
        else:
            self._wait_side(t.device)
            snap = buf.copy_(t.detach())
        self._snaps[key] = snap
        return snap

    def input_snapshots(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of a step's tensor arguments, before the step's work, in one launch: into
        buffers kept for that signature (shapes, dtypes), with ``torch._foreach_copy_``."""
        # This runs before the program's step is queued, so every µs here delays the device: the
        # key is built from the stream's id (no Stream object), the shapes and devices, and whether the
        # side stream reads these buffers is kept with them.
        # Per stream too: the packing that reads them is queued on the program's stream.
        key = (_stream_id(tensors[0]), *((t.shape, t.dtype, t.get_device()) for t in tensors))
        kept = self._input_static.get(key)
        if kept is None:
            if not self._may_keep(sum(t.numel() * t.element_size() for t in tensors)):
                return [t.detach().clone() for t in tensors]
            with _normal_tensors():
                dsts = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
            kept = self._input_static[key] = (dsts, any(t.numel() * t.element_size() > SMALL_BYTES for t in tensors))
            self._static_ids.update(id(d) for d in dsts)
        dsts, large = kept
        if large:
            self._wait_side(tensors[0].device)  # large ones are read by the side stream
        if any(t.requires_grad for t in tensors):
            tensors = [t.detach() for t in tensors]
        torch._foreach_copy_(dsts, tensors)
        return dsts

    def _may_keep(self, nbytes: int) -> bool:
        """Room for one more kept buffer (or set of buffers) of ``nbytes``; counts it if so."""
        if len(self._static) + len(self._input_static) >= MAX_STATIC or self._static_bytes + nbytes > MAX_STATIC_BYTES:
            return False
        self._static_bytes += nbytes
        return True

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A copy the step made itself (of an argument, before the step's work): its snapshot."""
        self._snaps[(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)] = t
        return t

    def is_static(self, t: torch.Tensor) -> bool:
        return id(t) in self._static_ids

    def _wait_side(self, dev: torch.device) -> None:
        done = self._side_done.get(dev)
        if done is not None:
            _wait(self._streams.current(dev), done)
            self._side_done.pop(dev)  # once a step: later snapshots are ordered after this wait

    def wait_for_side(self) -> None:
        """The program's stream waits for everything queued on the side streams (before the
        host or the program's stream reads what the side stream wrote: the logits ring)."""
        for dev, side in self._side.items():
            torch.cuda.current_stream(dev).wait_stream(side)

    def ring_copy(self, e: Entry, snap: torch.Tensor) -> None:
        """The logits ring's own copy of a step's logits (a static snapshot is overwritten by
        the next step): made on the side stream."""
        if self.is_static(snap):
            self._ring_copies.append((e, snap))
        else:
            e.device_copy = snap

    def _defer(self, keep: torch.Tensor, op: Any) -> None:
        self._later.append((keep, op))

    def place_pending(self, job: RingJob | None) -> None:
        """The step's end: room in the ring (or pinned buffers) for the snapshots taken during
        the step; their copies into it are queued by ``stage``, on the side stream."""
        self._place_area(job)
        pending, self._pending = self._pending, []
        for what, packed, nbytes in pending:
            if packed is None:
                e, snap = what
                self.copy_out(job, e, snap, nbytes, later=True)
                continue
            host, at = self._host_for(job, torch.uint8, (nbytes,), nbytes)
            self._defer(packed, (host, packed))
            if job is not None:
                job.cuda = packed.device
            off = 0
            for e, t in what:
                n = t.numel() * t.element_size()
                e.packed = (host, off, n)
                if at >= 0:
                    e.ring_at = at + off
                off += n
            if at < 0:
                what[0][0].release = self._last_buf

    def discard(self) -> None:
        """Forget the open step's device work (the step is not recorded)."""
        self._later = []
        self._snaps = {}
        self._pending = []
        self._ring_copies = []
        self._area_entries, self._area_used, self._area_dev = [], 0, None

    def _side_stream(self, dev: torch.device) -> Any:
        s = self._side.get(dev)
        if s is None:
            s = self._side[dev] = torch.cuda.Stream(dev)
        return s

    def _enter_side(self, dev: torch.device, later: list[Any], snaps: dict[tuple, torch.Tensor]) -> Any:
        """Order the side stream after what the program's stream has queued so far, hand it the
        snapshots (the allocator must not reuse them before it has read them), and make it the
        current stream; returns the stream context to leave."""
        side = self._side_stream(dev)
        program = self._streams.current(dev)
        # One event per device orders the side stream after the program's: a wait takes the
        # event's state when it is queued, so recording it again next step is safe.
        order = self._order_events.get(dev)
        if order is None:
            order = self._order_events[dev] = torch.cuda.Event()
        _record(order, program)
        _wait(side, order)
        for t in [*(keep for keep, _ in later), *snaps.values()]:
            if not self.is_static(t):  # kept buffers are never freed
                t.record_stream(side)
        if _RAW_STREAMS and dev.index == _current_device_raw():  # type: ignore[misc]
            _set_stream_raw(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)  # type: ignore[misc]
            return _Side(side, dev, program)
        ctx = torch.cuda.stream(side)  # another device's side stream: the context switches devices too
        ctx.__enter__()
        return _Side(side, dev, program, ctx)

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
            if nbytes and _plain_bytes(t):
                # One C call: numpy or torch views of the ring cost a few µs a tensor, and a
                # step's Python runs with the caches cold (the model's forward just ran).
                _memmove(self._ring_address + at, t.data_ptr(), nbytes)
                e.npv = data[at : at + nbytes]
                e.ring_at = at
                continue
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
        flat = [_flat_bytes(t) for _, t in small]
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

    def copy_out(self, job: RingJob | None, e: Entry, t: torch.Tensor, nbytes: int, *, later: bool = False) -> None:
        host, at = self._host_for(job, t.dtype, tuple(t.shape), nbytes)
        if later:
            self._defer(t, (host, t))
        else:
            host.copy_(t, non_blocking=self.cuda_async)
        e.host = host
        if at >= 0:
            e.ring_at = at
        else:
            e.release = self._last_buf
        if job is not None:
            job.cuda = t.device

    def stage(self, job: Job, device: list[torch.Tensor] | None, margin: torch.Tensor | None, rjob: RingJob | None = None,
              *, step: bool = False, logits: torch.Tensor | None = None) -> None:
        """Queue the device work of a job: digests, scalars, and the event the writer waits on.
        ``margin``: the job's top-2 margin, or ``logits`` to compute it from. A step's
        (``step``) deferred work goes to the side stream, which stays current until
        ``seal_job`` has queued the commit."""
        later, snaps = (self._later, self._snaps) if step else ([], {})
        if step:
            self._later, self._snaps = [], {}
        dev = _cuda_device(later, device, logits) if (later or snaps) else None
        job.side = self._enter_side(dev, later, snaps) if dev is not None else None
        try:
            for _keep, (host, src) in later:
                host.copy_(src, non_blocking=self.cuda_async)
            if step:
                copies, self._ring_copies = self._ring_copies, []
                for e, snap in copies:
                    e.device_copy = snap.clone()
            if job.side is not None and (device or logits is not None):
                reads = [*(device or []), *([logits] if logits is not None else [])]
                self._stage_tail(job, device or [], logits, rjob, static=all(map(self.is_static, reads)))
                device, margin = None, None
            elif logits is not None:
                from replay.record.margin import device_margin

                margin = device_margin(logits)
            self._stage(job, device, margin, rjob)
        except BaseException:
            self.leave_side(job)
            raise
        if rjob is None:
            self.leave_side(job)

    def leave_side(self, job: Job) -> None:
        """Make the program's stream current again; the next step's snapshots wait (on the
        device) for what the side stream has queued up to here."""
        side, job.side = job.side, None
        if side is None:
            return
        done = job.event
        if done is None:
            done = torch.cuda.Event()
            _record(done, side.stream)
        self._side_done[side.dev] = done
        if side.ctx is not None:
            side.ctx.__exit__(None, None, None)
        else:
            p = side.program
            _set_stream_raw(stream_id=p.stream_id, device_index=p.device_index, device_type=p.device_type)  # type: ignore[misc]

    def _stage_tail(self, job: Job, device: list[torch.Tensor], logits: torch.Tensor | None, rjob: RingJob | None, *,
                    static: bool) -> None:
        """The digests and margin of a step's snapshots, by its plan (one graph launch once the
        signature is captured), and one copy of them to the host."""
        tail = self.plans.run(device, logits, static=static)
        n = len(device)
        host, at = self._host_for(rjob, torch.int64, (n + 1,), 8 * (n + 1))
        host.copy_(tail, non_blocking=self.cuda_async)
        if at < 0:
            job.releases.append(self._last_buf)
        elif rjob is not None:
            rjob.cuda = tail.device
        if n:
            job.digests_host, job.digests_at = host[:n], at
        if logits is not None:
            job.margin_host = host[n:].view(torch.float32)[:1]
            job.margin_at = at + 8 * n if at >= 0 else -1
        job.cuda_work = True

    def _stage(self, job: Job, device: list[torch.Tensor] | None, margin: torch.Tensor | None, rjob: RingJob | None) -> None:
        for entries in job.groups.values():
            job.releases.extend(e.release for e in entries if e.release is not None)
        cuda_work = bool(job.releases) or job.cuda_work
        if device:
            from replay.digest import digest_into

            n = len(device)
            dev = device[0].device
            buf = self._device_digests.get(dev)
            if buf is None or buf.numel() < n:
                with _normal_tensors():
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
        raw = self.meta_text.encode(meta)
        if len(raw) <= META_ROOM:
            at, meta_pos = rjob.header_at + JOB_HEADER_BYTES, rjob.start + JOB_HEADER_BYTES
        else:
            try:
                at = ring.alloc(len(raw), block=self.block, timeout=self.timeout)
            except RingFull:
                self.leave_side(job)
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
                c = self._commits[device] = self._new_commit(device)
            c.count += 1
            expected = c.count
        ring.write_job_header(rjob.header_at, kind, seq, meta_pos, len(raw), ring.head, zlib.crc32(raw), dev_commit, expected)
        if dev_commit:
            self._queue_commit(c, job, rjob.header_at, expected, device)
            job.event = torch.cuda.Event()
            if job.side is not None:
                _record(job.event, job.side.stream)  # the side stream is the current one
            else:
                job.event.record()
        job.ring_end = ring.head
        job.seq = seq
        self.leave_side(job)
        return True

    def _new_commit(self, device: torch.device) -> _Commit:
        with _normal_tensors():
            return _Commit(counter=torch.zeros(1, dtype=torch.int64, device=device))

    def _open_writer(self, c: _Commit, device: torch.device) -> None:
        """The driver's stream write for ``c``'s device, the first time a commit asks for it (its
        opening tests it on the device, with a sync: never when the setting is off)."""
        c.writer_tried = True
        # It needs the ring registered with CUDA (the ring's device address).
        if self.cuda_async and self.ring is not None and self.ring.registered:
            writer = open_stream_writer(device)
            base = writer.device_pointer(self.ring.torch_data().data_ptr()) if writer is not None else None
            if writer is not None and base is not None:
                c.writer, c.ring_base = writer, base

    def _queue_commit(self, c: _Commit, job: Job, header_at: int, expected: int, device: torch.device) -> None:
        """The job's commit word, ``expected``, written after its copies on the stream they were
        queued on (the side stream, or the current one)."""
        assert self.ring is not None
        if self.driver_commit and not c.writer_tried:
            self._open_writer(c, device)
        if c.writer is not None and self.driver_commit:
            stream = job.side.stream if job.side is not None else torch.cuda.current_stream(device)
            if c.writer.write(stream.cuda_stream, c.ring_base + header_at + COMMIT_OFFSET, expected):
                return
            c.writer = None  # refused once: the counter and the copy from now on
        c.counter.fill_(expected)
        self.ring.commit_view(header_at).copy_(c.counter, non_blocking=self.cuda_async)


def _normal_tensors() -> Any:
    """Buffers the recorder keeps from step to step are made outside inference mode: one made
    inside it could not be written in place by a later step run outside it (the same program may
    run some steps under ``torch.inference_mode()`` and others not)."""
    return torch.inference_mode(False)


def _cuda_device(later: list[Any], device: list[torch.Tensor] | None, margin: torch.Tensor | None) -> torch.device | None:
    """The CUDA device of a job's device work, if any."""
    for t in [k for k, _ in later] + list(device or ()) + ([margin] if margin is not None else []):
        if t.device.type == "cuda":
            return t.device
    return None
