"""``replay.Recorder``: the in-process recorder an engine (or ``replay record``) calls.

Contract with the program it records:

- it never changes what the program computes: it only reads tensors (digest kernels, copies);
- it never raises into the program and never hangs it: any failure logs one warning, switches
  recording off, and the program goes on;
- the step path only enqueues: a step's record goes into this rank's record ring
  (``replay.record.ring``), a shared mapping in ``/dev/shm`` registered with CUDA: the host writes
  its facts and CPU tensors there, the device's copies land there, a commit word is written last;
  a drain thread (``replay.record.writer``) moves whole records to the journal at its own pace;
- a step is durable once its record is in the ring (host data: when ``end_step`` returns; device
  data: once the GPU has run the step's copies, queued before anything the program queues next):
  the ring outlives a SIGKILL, and ``replay seal`` salvages it (``replay.format.ring_salvage``);
- without a ring (none configured, no ``/dev/shm``, CUDA cannot register it) the record goes to
  the writer thread through pinned buffers, and ``durability="step"`` waits for the write.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import functools
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch

from replay.digest import local_tensor
from replay.format.journal import FrameKind, JournalWriter
from replay.format.manifest import host_facts, numerics_env, numerics_flags, versions, write_manifest
from replay.format.schema import FORMAT_VERSION, TensorKind, dtype_to_str, rank_stem
from replay.format import perms as _perms  # issue 16
from replay.format.ring_salvage import assemble_collectives as _assemble_collectives
from replay.format.ring_salvage import salvage_ring
from replay.format.seal import seal_rank
from replay.log import get_logger
from replay.record import rng as _rng
from replay.core.outputs import tensor_version
from replay.core.structure import UNRECORDED_ARG
from replay.record.calls import cuda_capturing, unrecordable
from replay.record.config import RecorderConfig
from replay.record.margin import device_margin, host_margin
from replay.record.ring import ShmRing, ring_pointer
from replay.record.ring_setup import drop_drained_ring, open_rank_ring
from replay.record.job_meta import job_meta
from replay.record.staging import RingJob, Staging, dtype_str
from replay.record.drain import DrainFailed, DrainProcess
from replay.record.writer import Entry, Job, Writer, entry_tensor

__all__ = ["Recorder"]

# The logits ring's copies stay on the device (CUDA logits): at most this many bytes of them.
LOGITS_RING_BYTES = 512 << 20

log = get_logger("replay.record")
_thread_id = threading.get_ident
F = TypeVar("F", bound=Callable[..., Any])


def _failsafe(default: Any = None) -> Callable[[F], F]:
    """Run a public recorder method so that no exception can reach the program."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: "Recorder", *args: Any, **kwargs: Any) -> Any:
            if self._disabled or (self._other_threads and _thread_id() in self._other_threads):
                return default
            try:
                # One thread at a time: a program's threads may record (a step in one, a graph
                # captured or a collective in another), and the record ring's jobs are sealed
                # in the order they are opened.
                with self._lock:
                    return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the contract is: never raise into the program
                self._fail(e)
                return default

        return inner  # type: ignore[return-value]

    return wrap


def _host_count(t: torch.Tensor) -> int:
    """The sum of a CPU tensor of counts (a step's accepted tokens) as an int. A list's sum for a
    row of integers: a torch ``sum`` costs ~15 µs right after the model's forward, this ~4."""
    if t.dim() <= 1 and not t.is_floating_point() and not t.is_complex():
        v = t.tolist()
        return int(sum(v)) if isinstance(v, list) else int(v)
    return int((t.detach() if t.requires_grad else t).sum())


@dataclass(slots=True)
class _Step:
    index: int
    t0: float
    thread: int = 0  # the thread that began it: only its records go into the step
    groups: dict[str, list[Entry]] = field(default_factory=dict)
    device: list[torch.Tensor] = field(default_factory=list)  # tensors digested on the device
    collectives: list[dict[str, Any]] = field(default_factory=list)
    replays: list[int] = field(default_factory=list)
    run: dict[str, Any] | None = None
    margin_dev: torch.Tensor | None = None
    margin_logits: torch.Tensor | None = None  # a snapshot of the logits: the margin is computed on the side stream
    margin_src: Any = None  # a host tensor, or (uint8 numpy view, dtype, shape) in the ring
    logits_key: tuple | None = None
    # A CPU step's logits copied into the ring for the margin when a probe saw them, and their
    # version then: the same logits returned unchanged are recorded from that copy.
    margin_copy: Entry | None = None
    margin_version: int = -1
    accepted: int | None = None
    accepted_entry: Entry | None = None
    accepted_nbytes: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    rjob: RingJob | None = None  # the step's allocations in the record ring
    rjob_opened: bool = False  # opened when first needed (CPU tensors), else at the step's end
    rng: dict[str, torch.Tensor] | None = None  # generator states at the step's start
    fin: dict[str, Any] = field(default_factory=dict)  # what salvage computes from the bytes


_STRIDED = torch.strided


def _unnamed_ids(name: str, t: torch.Tensor) -> bool:
    """An integer tensor a step returns by place, unnamed (``return next_tok, logits``: ``out0``;
    ``return next_tokens`` alone, or the sampled token as a Python int: ``output``): sampled ids,
    as a probe's integer outputs are taken; compared first, as tokens. (A named output is a token
    field only by name: an engine's ``drafts`` stay outputs.)"""
    return (name == "output" or name.startswith("out") and name[3:].isdigit()) and not (t.is_floating_point() or t.is_complex()) \
        and t.dtype is not torch.bool and t.numel() <= _MAX_UNNAMED_IDS


# An unnamed integer output kept whole as tokens up to this many elements (sampled ids of a batch).
_MAX_UNNAMED_IDS = 1 << 16


def _recordable(st: _Step, group: str, named: list[tuple[str, torch.Tensor]], said: set[str]) -> list[tuple[str, torch.Tensor]]:
    """``named`` without the tensors whose values are not a dense array of bytes, which are
    named in the step's arguments (``UNRECORDED_ARG``) instead, with one warning a name (``said``:
    the names warned of). The step path pays three attribute reads a tensor; ``unrecordable``
    runs only when one of them says so."""
    if all(t.layout is _STRIDED and not t.is_nested and not t.is_quantized for _, t in named):
        return named
    kept = []
    for n, t in named:
        why = unrecordable(t)
        if why is None:
            kept.append((n, t))
            continue
        field_name = f"{group}.{n}"
        st.args.setdefault(UNRECORDED_ARG, {})[field_name] = why
        if field_name not in said:
            said.add(field_name)
            log.warning("%s is a %s: not recorded, and a re-run does not compare it (recording goes on)", field_name, why)
    return kept


def _outside_ring(job: Job) -> bool:
    """Whether some of what a ring job's frame needs lies in pinned buffers outside the ring
    (no room there when it was taken): only this process can write such a job."""
    return bool(job.releases) or (job.digests_host is not None and job.digests_at < 0) or \
        (job.margin_host is not None and job.margin_at < 0)



def _has_margin(t: torch.Tensor) -> bool:
    """Logits with a top-1/top-2 margin: floats with two or more values a row, and a row at all
    (a decode step of continuous batching runs on an empty batch once its requests are done)."""
    return t.is_floating_point() and t.dim() >= 1 and t.shape[-1] >= 2 and t.numel() > 0

class Recorder:
    """Records one rank. Create one per process; see ``RecorderConfig`` for the settings."""

    def __init__(self, config: RecorderConfig, *, state_fn: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
        self.config = config
        self.uncaught: str | None = None  # the error the program ended on, for the end marker (replay.record.auto)
        self.state_fn = state_fn
        self._disabled = False
        self._warned = False
        self._closed = False
        self._lock = threading.RLock()
        # Called with the recorder when it closes, before its end marker (what its owner notes last).
        self.before_close: list[Callable[[Recorder], None]] = []
        self._step_counter = 0
        self._cur: _Step | None = None
        # Threads whose steps began while another thread's step was open: one step is recorded
        # at a time, so from then on nothing of theirs is (their records would land in the other
        # thread's step, and the record ring's jobs would interleave).
        self._other_threads: set[int] = set()
        self._graph_counter = 0
        self._collective_counter = 0
        self._keyframe_at: int | None = None  # the step the next keyframe is due at
        self._ring: collections.deque[tuple[int, Entry]] = collections.deque(maxlen=max(config.ring, 1))
        self._ring_capped = False  # the logits ring was cut below ``ring`` steps (noted once)
        self._unrecorded_said: set[str] = set()  # tensors named as not recordable (warned once each)
        self._staging = Staging()
        self._pool = self._staging.pool
        self._rr: ShmRing | None = None  # the record ring (``_ring`` is the logits ring)
        self._seq = 0  # sequence number of the next job (journal order)
        self._deferred: list[Job] = []  # host-only jobs that came during a step: after its record
        self._dropped: list[int] = []  # steps not recorded: the ring was full (policy "drop")
        self._gaps: list[Job] = []  # their notes, when not even a note had room
        self._ring_final: dict[str, Any] | None = None
        self._writer: Writer | None = None
        self._lock_fd: int | None = None
        self.part_dir = config.out / config.part
        self.error: str | None = None
        try:
            self._open()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        # Close at exit so the ring is written and the file sealed; weakly, so an abandoned
        # recorder can still be collected.
        ref = weakref.ref(self)
        atexit.register(lambda: (r := ref()) is not None and r.close())

    # -- lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        cfg = self.config
        # issue 16: the recording and part directories are owner-only unless widened (replay/format/perms.py)
        _perms.mkdir(self.part_dir.parent, parents=True, exist_ok=True)
        _perms.mkdir(self.part_dir, exist_ok=True)
        stem = rank_stem(cfg.rank)
        journal = JournalWriter(
            self.part_dir / f"{stem}.journal", self.part_dir / f"{stem}.payload", max_bytes=cfg.max_bytes
        )
        # The lock tells readers and sealers that this journal is live; the kernel drops it when
        # the process dies, however it dies.
        self._lock_fd = os.open(journal.journal_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        header = {
            "format_version": FORMAT_VERSION,
            "rank": cfg.rank,
            "world_size": cfg.world_size,
            "part": cfg.part,
            "started_at": time.time(),
            "recorder": cfg.to_json(),
            "config": cfg.target,
            "env": numerics_env(),
            "numerics": numerics_flags(),
            "versions": versions(),
            **host_facts(),
        }
        journal.write_frame(FrameKind.HEADER, header)
        notes = self._open_ring(journal.journal_path)
        self._writer = self._start_drain(journal, notes)
        for n in notes:
            self.note(n)
        if cfg.rank == 0:
            write_manifest(
                cfg.out,
                {"created_at": time.time(), "host": socket.gethostname(), "world_size": cfg.world_size},
                replace=False,
            )

    def _start_drain(self, journal: JournalWriter, notes: list[str]) -> Writer | DrainProcess:
        """The drain: a process of its own with the ring (``drain = "process"``), else a thread."""
        cfg = self.config
        if self._rr is not None and cfg.drain == "process":
            try:
                assert self._lock_fd is not None
                return DrainProcess(journal, self._rr, pool=self._pool, on_error=self._fail, lock_fd=self._lock_fd)
            except Exception as e:  # noqa: BLE001 - a thread drains instead
                notes.append(f"the drain process could not be started ({e.__class__.__name__}: {e}): a thread drains the ring")
        return Writer(journal, depth=cfg.queue_depth, pool=self._pool, on_error=self._fail, ring=self._rr, lag_s=cfg.drain_lag_s)

    def _open_ring(self, journal_path: Any) -> list[str]:
        """This rank's record ring and the pointer beside the journal; notes say why not."""
        ring, notes = open_rank_ring(self.config, journal_path)
        if ring is None:
            return notes
        self._rr = ring
        # A recorder that is dropped or exits without closing: its ring leaves /dev/shm with it
        # when the drain had moved everything to the journal (else it stays for `replay seal`).
        self._ring_finalizer = weakref.finalize(self, drop_drained_ring, ring, ring_pointer(journal_path))
        self._staging = Staging(ring, block=self.config.ring_full == "block", timeout=self.config.sync_timeout_s)
        self._staging.pool = self._pool
        return notes

    @property
    def enabled(self) -> bool:
        return not self._disabled

    @property
    def step_index(self) -> int:
        """The index the next (or current) step has."""
        return self._cur.index if self._cur is not None else self._step_counter

    def _fail(self, e: BaseException) -> None:
        self._disabled = True
        if self.error is None:
            # The first failure is the cause; later ones (a step's wait seeing the dead writer)
            # only repeat it.
            # A drain process's error is its own line, already "Class: message".
            self.error = str(e) if isinstance(e, DrainFailed) else f"{e.__class__.__name__}: {e}"
        if not self._warned:
            self._warned = True
            log.warning(
                "recording stopped on rank %d: %s; the program goes on unrecorded (steps written so far are kept)",
                self.config.rank,
                self.error,
            )
        w = self._writer
        if w is not None:
            # Never wait here: the writer itself may be what failed or hung.
            threading.Thread(target=w.stop, args=(1.0,), daemon=True).start()

    def _post(self, job: Job, *, wait: bool = False) -> None:
        """A job without tensors (graph, note, tuner, target, end marker)."""
        if self._rr is None:
            self._submit(job, wait=wait)
        elif self._cur is not None and not wait:
            self._deferred.append(job)  # the step's allocations are open: after its record
        else:
            self._submit_ring(job, self._staging.open_job(), wait=wait)

    def _submit_ring(self, job: Job, rjob: RingJob | None, *, wait: bool = False) -> None:
        """Seal a job's record into the ring (header, meta, commit) and hand it to the drain."""
        if rjob is None:
            self._submit(job, wait=True)
            return
        if rjob.header_at < 0:
            if job.kind == FrameKind.NOTE and rjob.dropped:
                self._gaps.append(job)  # no room even for its note: written with the next job
                return
            rjob = self._staging.open_job_blocking()
        seq = self._seq
        meta = job_meta(job, rjob)
        if isinstance(self._writer, DrainProcess) and not meta.get("x") and _outside_ring(job):
            meta["x"] = 1  # the drain process cannot write it: this process does
        job.external = bool(meta.get("x"))
        if not self._staging.seal_job(job, rjob, seq, int(job.kind), meta):
            # Policy "drop" and no room for the meta: the job becomes a note in its own reserve.
            self._dropped.append(int(job.body.get("step", -1)))
            job = Job(kind=FrameKind.NOTE, body={"step": job.body.get("step", -1), "message": f"a {job.kind.name.lower()} record was not kept: the record ring was full"})
            job.cuda_work = rjob.cuda is not None
            self._staging.seal_job(job, rjob, seq, int(job.kind), job_meta(job, rjob))
        self._seq += 1
        self._submit(job, wait=wait or rjob.external)
        while self._gaps:
            gap_job = self._staging.open_job()
            if gap_job is None or gap_job.header_at < 0:
                break
            gap = self._gaps.pop(0)
            self._staging.seal_job(gap, gap_job, self._seq, int(gap.kind), job_meta(gap, gap_job))
            self._seq += 1
            self._submit(gap, wait=False)
        for n in self._staging.notes:
            self._staging.notes = []
            self.note(n)

    def _submit(self, job: Job, *, wait: bool) -> None:
        assert self._writer is not None
        if wait:
            job.ack = threading.Event()
        if not self._writer.submit(job, timeout=self.config.sync_timeout_s):
            raise TimeoutError("the writer thread did not keep up")
        if wait and not job.ack.wait(self.config.sync_timeout_s):  # type: ignore[union-attr]
            raise TimeoutError(f"the writer thread took over {self.config.sync_timeout_s:.0f} s for one step")
        if self._writer.failed:
            raise RuntimeError(self.error or "writer failed")

    # -- tensors ---------------------------------------------------------------------------

    def _entry(self, st: _Step | None, name: str, kind: TensorKind, t: torch.Tensor, *, store: bool) -> Entry:
        """Capture ``t`` now (its value may change after this call returns)."""
        return self._entries(st, [(name, kind, t, store)])[0]

    def _entries(self, st: _Step | None, items: list[tuple[str, TensorKind, torch.Tensor, bool]],
                 rjob: RingJob | None = None) -> list[Entry]:
        if st is not None:
            # The step's room in the ring is opened once it is needed now: for CPU tensors (the
            # program may change them once the call returns); CUDA tensors are only snapshotted.
            if not st.rjob_opened and (not self._staging.defer or not all(t.is_cuda for _, _, t, _ in items)):
                self._step_ring(st)
            return self._staging.entries(st.rjob, st.device, items, step=True)
        return self._staging.entries(rjob, None, items)

    def _stage_device(self, st: _Step | None, job: Job, rjob: RingJob | None = None) -> None:
        if st is not None:
            self._staging.stage(job, st.device, st.margin_dev, st.rjob, step=True, logits=st.margin_logits)
        else:
            self._staging.stage(job, None, None, rjob)

    def _step_ring(self, st: _Step) -> RingJob | None:
        if not st.rjob_opened:
            st.rjob_opened = True
            st.rjob = self._staging.open_job()
        return st.rjob

    def _side_job(self) -> RingJob | None:
        """Ring allocations for a job with tensors outside a step (keyframe, collective, logits
        ring); None while a step's allocations are open: such a job goes to the writer."""
        return self._staging.open_job() if self._rr is not None and self._cur is None else None

    def _pinned_copy(self, job: Job, t: torch.Tensor) -> torch.Tensor:
        return self._staging.pinned_copy(job, t)

    # -- steps -----------------------------------------------------------------------------

    @_failsafe(default=-1)
    def begin_step(self, *, checked: bool = False) -> int:
        """Start a step; returns its index. Takes the keyframe and RNG state due at its start.
        ``checked``: the caller has just seen that no CUDA graph is being captured."""
        if not checked and cuda_capturing():
            return -1
        with self._lock:
            tid = _thread_id()
            if self._cur is not None and self._cur.thread != tid:
                self._exclude_thread(tid)
                return -1
            if self._cur is not None:
                self._end(error="step did not end before the next began")
            st = _Step(index=self._step_counter, t0=time.time(), thread=tid)
            self._step_counter += 1
            due = self._keyframe_due(st.index)
            if self.state_fn is not None and due:
                self._keyframe(st.index, self.state_fn())
            if self.config.rng:
                # Fresh tensors: they go into the step's record at its end, off the step's path.
                st.rng = _rng.capture_rng(host=due)
            self._cur = st
            return st.index

    def records_this_thread(self) -> bool:
        """Whether a step this thread begins now can be recorded: False when another thread's
        step is open (this thread is then left out from here on) or this thread was left out."""
        if self._disabled:
            return False
        tid = _thread_id()
        with self._lock:
            if tid in self._other_threads:
                return False
            if self._cur is not None and self._cur.thread != tid:
                self._exclude_thread(tid)
                return False
        return True

    def _mine(self) -> _Step | None:
        """The open step, if this thread began it (another thread's records stay out of it)."""
        st = self._cur
        return st if st is not None and st.thread == _thread_id() else None

    def _exclude_thread(self, tid: int) -> None:
        """A step began in thread ``tid`` while another thread's step was open."""
        self._other_threads.add(tid)
        name = next((t.name for t in threading.enumerate() if t.ident == tid), str(tid))
        message = (f"steps ran in two threads at once: thread {name!r} began a step while another thread's step "
                   f"{self._cur.index if self._cur is not None else '?'} was open; replay records one step at a time, "
                   f"so nothing of thread {name!r} is recorded from here on")
        log.warning("%s (rank %d)", message, self.config.rank)
        self._post(Job(kind=FrameKind.NOTE, body={"step": self.step_index, "message": message}))

    def open_step_args(self) -> dict[str, Any] | None:
        """The open step's non-tensor arguments recorded so far (a copy), whichever thread began
        it; None: no step open."""
        st = self._cur
        return dict(st.args) if st is not None else None

    @_failsafe()
    def add_open_step_args(self, **args: Any) -> None:
        """Add to the open step's arguments, whichever thread began it (a step another thread is
        running when this one closes the part: its after-call bookkeeping will not come)."""
        st = self._cur
        if st is not None:
            st.args.update(args)

    def early_ok(self) -> bool:
        """Whether a step may begin before its arguments are bound (``Session._early_step``):
        CUDA record work on the side stream, no step open (the caller checks that the step's
        tensors are CUDA ones: CUDA is initialised then)."""
        return self._staging.defer and self._cur is None and not self._disabled

    def snapshot_arguments(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the open step's tensor arguments as they are now (one launch); give them
        to ``adopt_snapshot`` before recording them as inputs."""
        return self._staging.input_snapshots(tensors)

    def adopt_snapshot(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` is the open step's own copy of an argument: recorded as it is, not copied again."""
        return self._staging.adopt(t)

    @_failsafe()
    def record_inputs(self, **tensors: torch.Tensor) -> None:
        st = self._mine()
        if st is None:
            return
        store = self.config.inputs == "full"
        named = _recordable(st, "inputs", [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)], self._unrecorded_said)
        items = [(name, TensorKind.INPUT, t, store) for name, t in named]
        st.groups.setdefault("inputs", []).extend(self._entries(st, items))

    @_failsafe()
    def record_outputs(self, **tensors: torch.Tensor) -> None:
        st = self._mine()
        if st is None:
            return
        cfg = self.config
        named = _recordable(st, "outputs", [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)], self._unrecorded_said)
        items = [
            (n, TensorKind.TOKENS, t, True) if n in cfg.token_outputs or _unnamed_ids(n, t) else
            (n, TensorKind.OUTPUT, t, cfg.outputs == "full")
            for n, t in named
        ]
        for (name, t), e in zip(named, self._output_entries(st, items)):
            st.groups.setdefault("tokens" if e.kind == TensorKind.TOKENS else "outputs", []).append(e)
            if e.kind == TensorKind.OUTPUT and name == cfg.logits and _has_margin(t):
                self._logits(st, t, e)
            if name == cfg.accepted:
                if t.is_cuda:
                    st.accepted_entry = e  # its place in the ring (for salvage) is known at the step's end
                    st.accepted_nbytes = t.numel() * t.element_size()
                else:
                    st.accepted = _host_count(t)

    def _output_entries(self, st: _Step, items: list[tuple[str, TensorKind, torch.Tensor, bool]]) -> list[Entry]:
        """The outputs' entries; CPU logits a probe saw, unchanged since, from the ring copy made
        for their margin then (not a second copy of the step's largest tensor)."""
        copy = st.margin_copy
        at = -1 if copy is None else next((i for i, (_, _, t, _) in enumerate(items) if self._is_margin_copy(st, t)), -1)
        if at < 0:
            return self._entries(st, items)
        name, kind, t, store = items[at]
        assert copy is not None
        reused = Entry(name=name, kind=kind, dtype=copy.dtype, shape=copy.shape, store=store, host=copy.host,
                       ring_at=copy.ring_at, npv=copy.npv)
        rest = self._entries(st, items[:at] + items[at + 1:]) if len(items) > 1 else []
        return [*rest[:at], reused, *rest[at:]]

    @staticmethod
    def _is_margin_copy(st: _Step, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and not t.is_cuda and tensor_version(t) == st.margin_version
                and st.logits_key == (t.data_ptr(), tuple(t.shape), t.dtype))

    @_failsafe()
    def record_tokens(self, **tensors: torch.Tensor) -> None:
        """Record sampled or accepted tokens in full, whatever their names."""
        st = self._mine()
        if st is None:
            return
        named = _recordable(st, "tokens", [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)], self._unrecorded_said)
        items = [(n, TensorKind.TOKENS, t, True) for n, t in named]
        st.groups.setdefault("tokens", []).extend(self._entries(st, items))

    @_failsafe()
    def record_logits(self, t: torch.Tensor) -> None:
        """The step's logits, for its top-2 margin and the logits ring, without adding a field
        (a probe sees them before a step that later raises could return them)."""
        st = self._mine()
        if st is not None and isinstance(t, torch.Tensor) and _has_margin(t):
            self._logits(st, t, None)

    def _logits(self, st: _Step, t: torch.Tensor, entry: Entry | None) -> None:
        t = local_tensor(t)  # topk of a sharded DTensor would be a collective
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if st.logits_key == key:
            return  # the same logits seen twice in a step (a probe's argument, then the output)
        st.logits_key = key
        snap = None
        if t.is_cuda and self._staging.defer:
            snap = st.margin_logits = self._staging.snapshot(t)
        elif t.is_cuda:
            st.margin_dev = device_margin(t.detach())
        else:
            if entry is None or entry.packed is not None:
                entry = self._staging.entries(self._step_ring(st), None, [("margin", TensorKind.OUTPUT, t, False)])[0]
                version = tensor_version(t)  # (an inference tensor keeps none: its writes cannot be told)
                if version is not None and entry.packed is None and entry.release is None:
                    st.margin_copy, st.margin_version = entry, version
            # The margin is computed by the drain, from the copy the entry made.
            st.margin_src = entry.host if entry.host is not None else (entry.npv, t.dtype, tuple(t.shape))
            if entry.ring_at >= 0:
                st.fin["margin"] = [entry.ring_at, entry.dtype, list(entry.shape)]
        if self.config.ring:
            dtype, shape = dtype_str(t.dtype), tuple(t.shape)
            if t.is_cuda:
                # The ring stays on the device (a device-to-device copy costs microseconds);
                # it is copied out only when it is written: at exit, on a crash or a trigger.
                ring_e = Entry(name="logits", kind=TensorKind.LOGITS, dtype=dtype, shape=shape, store=True)
                if snap is not None:
                    self._staging.ring_copy(ring_e, snap)
                else:
                    ring_e.device_copy = t.detach().clone()
            else:
                # The record ring's bytes are reused once drained: the logits ring keeps its own copy.
                # (detach only when there is a history: it costs µs even when there is none)
                host_copy = entry.host if self._rr is None and entry.host is not None else \
                    (t.detach() if t.requires_grad else t).clone()
                ring_e = Entry(name="logits", kind=TensorKind.LOGITS, dtype=dtype, shape=shape, host=host_copy, store=True)
            if self._ring and self._ring[-1][0] == st.index:
                self._ring.pop()
            self._ring.append((st.index, ring_e))
            self._bound_logits_ring(t.numel() * t.element_size())

    def _bound_logits_ring(self, nbytes: int) -> None:
        """The logits ring holds at most ``LOGITS_RING_BYTES`` (on the device for CUDA logits:
        memory the program may need); fewer steps than ``ring`` when the logits are large."""
        keep = max(1, LOGITS_RING_BYTES // max(nbytes, 1))
        if keep >= len(self._ring):
            return
        while len(self._ring) > keep:
            self._ring.popleft()
        if not self._ring_capped:
            self._ring_capped = True
            self.note(f"the logits ring keeps {keep} of {self.config.ring} steps: a step's logits are "
                      f"{nbytes / 2**20:.1f} MiB and the ring holds at most {LOGITS_RING_BYTES >> 20} MiB")

    @_failsafe()
    def record_probe(self, name: str, **tensors: torch.Tensor) -> None:
        """Outputs of a callable inside the step (a probe), as fields of the step in call order.

        Integer tensors count as tokens (compared first for token divergence), the rest as outputs.
        Probes see what a step computed even when the step later raises (a lockstep check)."""
        st = self._mine()
        if st is None:
            return
        items = []
        for k, t in _recordable(st, "outputs", [(f"{name}.{k}", t) for k, t in tensors.items() if isinstance(t, torch.Tensor)], self._unrecorded_said):
            fp = t.is_floating_point() or t.is_complex()
            items.append((k, TensorKind.OUTPUT if fp else TensorKind.TOKENS, t, not fp))
        for e in self._entries(st, items):
            st.groups.setdefault("tokens" if e.kind == TensorKind.TOKENS else "outputs", []).append(e)

    @_failsafe()
    def set_run(self, mode: str, *, key: str = "", padded_size: int = -1, reason: str = "") -> None:
        """Say how the current step ran: ``mode`` "graph" (with its key) or "eager" (and why)."""
        st = self._mine()
        if st is not None:
            st.run = {"mode": mode, "key": key, "padded": int(padded_size), "reason": reason}

    @_failsafe()
    def end_step(self, *, error: BaseException | str | None = None) -> None:
        """Finish the current step (``error``: it raised). With durability "step", waits for the write."""
        with self._lock:
            if self._cur is not None and self._cur.thread == _thread_id():
                self._end(error=error)

    def _end(self, *, error: BaseException | str | None) -> None:
        st, self._cur = self._cur, None
        assert st is not None
        body: dict[str, Any] = {"step": st.index, "t0": st.t0, "t1": time.time(), "status": "ok"}
        if error is not None:
            body["status"] = "raised"
            body["error"] = error if isinstance(error, str) else f"{error.__class__.__name__}: {error}"
        if st.run is not None:
            body["run"] = st.run
        if st.replays:
            body["replays"] = st.replays
            if st.run is None:
                body["run"] = {"mode": "graph", "key": f"graph{st.replays[-1]}", "padded": -1, "reason": ""}
        if st.accepted is not None:
            body["accepted"] = st.accepted
        if st.args:
            body["args"] = st.args
        if st.collectives:
            self._take_async_outputs(st)
        rjob = self._step_ring(st)
        if st.rng:
            st.groups = {"rng": self._staging.entries(rjob, None, [(k, TensorKind.RNG, v, True) for k, v in st.rng.items()]), **st.groups}
        self._staging.place_pending(rjob)
        acc = st.accepted_entry
        if acc is not None and acc.ring_at >= 0:
            st.fin["acc"] = [acc.ring_at, acc.dtype, list(acc.shape), st.accepted_nbytes]
        job = Job(kind=FrameKind.STEP, body=body, groups=dict(st.groups))
        coll_meta = self._stage_collectives(st, job)
        if st.rjob is not None and st.rjob.dropped:
            self._staging.discard()
            self._drop(st, job)
            return
        try:
            self._stage_device(st, job)
            self._submit_step(st, job, coll_meta)
        finally:
            self._staging.leave_side(job)  # the program's stream is current again, whatever happened

    def _submit_step(self, st: _Step, job: Job, coll_meta: list[dict[str, Any]]) -> None:
        accepted_entry = st.accepted_entry
        margin_src = st.margin_src

        def finish(j: Job) -> None:
            if coll_meta:
                j.body["collectives"] = _assemble_collectives(j.body, coll_meta)
            if margin_src is not None:
                j.body["margin"] = host_margin(margin_src)
            accepted = entry_tensor(accepted_entry) if accepted_entry is not None else None
            if accepted is not None:
                j.body["accepted"] = int(accepted.to(torch.int64).sum())

        job.finish = finish
        if coll_meta:
            st.fin["coll"] = coll_meta
        if st.rjob is not None:
            job.fin = st.fin
            self._submit_ring(job, st.rjob)  # sealing it queues the commit and leaves the side stream
            deferred, self._deferred = self._deferred, []
            for d in deferred:
                self._submit_ring(d, self._staging.open_job())
        else:
            self._submit(job, wait=self.config.durability == "step")

    def _drop(self, st: _Step, job: Job) -> None:
        """The ring was full (policy "drop"): the step becomes a note that names it."""
        self._dropped.append(st.index)
        note = Job(kind=FrameKind.NOTE, body={"step": st.index, "message": f"step {st.index} not recorded: the record ring was full"})
        # Copies of the step already queued land in its room: the drain must wait for them.
        note.cuda_work = st.rjob is not None and st.rjob.cuda is not None
        self._submit_ring(note, st.rjob)
        deferred, self._deferred = self._deferred, []
        for d in deferred:
            self._submit_ring(d, self._staging.open_job())

    def _stage_collectives(self, st: _Step, job: Job) -> list[dict[str, Any]]:
        meta = []
        for i, c in enumerate(st.collectives):
            job.groups[f"_cin{i}"] = c.pop("inputs")
            job.groups[f"_cout{i}"] = c.pop("outputs")
            meta.append(c)
        return meta

    @contextlib.contextmanager
    def step(self) -> Iterator["Recorder"]:
        """``with rec.step(): ...``: begin and end a step; an exception marks it as raised."""
        self.begin_step()
        try:
            yield self
        except BaseException as e:
            self.end_step(error=e)
            raise
        self.end_step()

    # -- events outside the step's tensors -------------------------------------------------

    @_failsafe()
    def snapshot_state(self, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write a state keyframe for the step about to run (default: ``state_fn()``)."""
        if tensors is None:
            if self.state_fn is None:
                return
            tensors = self.state_fn()
        self._keyframe(self.step_index, tensors)

    def _keyframe_due(self, index: int) -> bool:
        return index == 0 or (self._keyframe_at is not None and index >= self._keyframe_at)

    def _keyframe(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        every = self.config.keyframe_every
        if every:
            size = sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))
            interval = max(every, -(-size // max(self.config.keyframe_budget, 1)))
            if interval != every and self._keyframe_at is None:
                self.note(f"state is {size / 1e6:.1f} MB: keyframes every {interval} steps instead of {every}")
            self._keyframe_at = step + interval
        rjob = self._side_job()
        entries = self._entries(None, [(k, TensorKind.STATE, v, True) for k, v in tensors.items() if isinstance(v, torch.Tensor)], rjob)
        job = Job(kind=FrameKind.KEYFRAME, body={"step": step}, groups={"tensors": entries})
        self._stage_device(None, job, rjob)
        self._send(job, rjob)

    def _send(self, job: Job, rjob: RingJob | None) -> None:
        """Hand a job with tensors to the drain: through the ring, else the writer's queue (with
        a ring, such a job waits for its write: it is not in the ring for salvage to find)."""
        if rjob is not None:
            self._submit_ring(job, rjob)
        else:
            self._submit(job, wait=self._rr is not None)

    @_failsafe()
    def set_target(self, info: Mapping[str, Any], state_fn: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
        """Say what is being recorded (factory, config, step callable): what a re-run rebuilds."""
        if state_fn is not None:
            self.state_fn = state_fn
        self._post(Job(kind=FrameKind.TARGET, body=dict(info)))

    @_failsafe()
    def record_args(self, **args: Any) -> None:
        """The step's non-tensor arguments (JSON-safe values), needed to call it again."""
        st = self._mine()
        if st is not None:
            st.args.update(args)

    @_failsafe(default=-1)
    def record_graph(
        self,
        key: str,
        *,
        graph_id: int | None = None,
        padded_size: int = -1,
        pool: int = -1,
        kernels: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
        source: str = "",
    ) -> int:
        """Record a captured graph (its key, memory pool, kernels); returns its id for replays."""
        gid = self._graph_counter if graph_id is None else int(graph_id)
        self._graph_counter = max(self._graph_counter, gid + 1)
        body = {
            "graph": gid,
            "key": key,
            "padded": int(padded_size),
            "pool": int(pool),
            "step": self.step_index,
            "source": source,
            "kernels": list(kernels),
        }
        self._post(Job(kind=FrameKind.GRAPH, body=body))
        return gid

    @_failsafe()
    def record_graph_replay(self, graph_id: int) -> None:
        st = self._mine()
        if st is not None:
            st.replays.append(int(graph_id))
        else:
            self._post(Job(kind=FrameKind.REPLAY, body={"step": self.step_index - 1, "graph": int(graph_id)}))

    @_failsafe()
    def record_collective(
        self,
        op: str,
        *,
        group: str = "",
        group_size: int = 0,
        inputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
        outputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
        compare: bool = True,
        pending: Any = None,
    ) -> None:
        """Record one collective call after it completed (``compare``: all ranks get equal bits).
        ``pending``: an async collective's outputs, taken at the step's end if its work is done
        (``replay.record.collectives.AsyncOutputs``)."""
        if cuda_capturing():
            return
        st = self._mine()
        ordinal = self._collective_counter
        self._collective_counter += 1
        rjob = self._side_job() if st is None else None
        entries = self._entries(
            st,
            [(f"in{i}", TensorKind.COLLECTIVE, t, False) for i, t in enumerate(inputs)]
            + [(f"{op}.out{i}", TensorKind.COLLECTIVE, t, self._keep_collective(t)) for i, t in enumerate(outputs)],
            rjob,
        )
        ins, outs = entries[: len(inputs)], entries[len(inputs) :]
        meta = {
            "ordinal": ordinal,
            "op": op,
            "group": group,
            "group_size": int(group_size),
            "shapes": f"{[list(t.shape) for t in inputs]} -> {[list(t.shape) for t in outputs]}",
            "dtypes": ",".join(sorted({dtype_to_str(t.dtype) for t in (*inputs, *outputs)})),
            "compare": bool(compare),
            "inputs": ins,
            "outputs": outs,
        }
        if st is not None:
            if pending is not None:
                meta["pending"] = (pending, [list(t.shape) for t in inputs])
            st.collectives.append(meta)
            return
        job = Job(kind=FrameKind.COLLECTIVE, body={"step": self._step_counter - 1})
        coll = self._stage_collectives(_Step(index=-1, t0=0.0, collectives=[meta]), job)

        def finish(j: Job) -> None:
            j.body.update(_assemble_collectives(j.body, coll)[0])

        job.finish = finish
        job.fin = {"coll": coll, "single": True}
        self._stage_device(None, job, rjob)
        self._send(job, rjob)

    def _keep_collective(self, t: torch.Tensor) -> bool:
        """Whether a collective's output is stored in full (``--collectives``), not only digested."""
        mode = self.config.collectives
        return mode == "full" or (mode == "auto" and t.numel() * t.element_size() <= self.config.collective_full_bytes)

    def _take_async_outputs(self, st: _Step) -> None:
        """The outputs of the step's async collectives not waited on in it whose work is done by
        its end, unwritten since: recorded as a synchronous collective's are (a one-rank re-run
        hands them back)."""
        for c in st.collectives:
            pending = c.pop("pending", None)
            if pending is not None:
                self._async_outputs(st, c, pending, pending[0].taken())

    @_failsafe()
    def collective_waited(self, work: Any) -> None:
        """The program's ``wait()`` on ``work`` returned: if it is an async collective of the open
        step, its outputs are recorded now."""
        st = self._cur
        for c in st.collectives if st is not None else ():
            pending = c.get("pending")
            if pending is not None and pending[0].work is work:
                del c["pending"]
                self._async_outputs(st, c, pending, pending[0].taken(waited=True))
                return

    def _async_outputs(self, st: _Step, c: dict[str, Any], pending: tuple[Any, list[list[int]]],
                       outs: list[torch.Tensor] | None) -> None:
        if not outs:
            return
        op = c["op"]
        c["outputs"] = self._entries(st, [(f"{op}.out{i}", TensorKind.COLLECTIVE, t, self._keep_collective(t))
                                         for i, t in enumerate(outs)])
        c["compare"] = bool(pending[0].compare)
        c["shapes"] = f"{pending[1]} -> {[list(t.shape) for t in outs]}"

    @_failsafe()
    def record_tuner(self, choices: Mapping[str, str]) -> None:
        body = {"step": self.step_index, "choices": {str(k): str(v) for k, v in choices.items()}}
        self._post(Job(kind=FrameKind.TUNER, body=body))

    @_failsafe()
    def note(self, message: str) -> None:
        self._post(Job(kind=FrameKind.NOTE, body={"step": self.step_index, "message": message}))

    @_failsafe(default=False)
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every record handed over so far is in the journal (not needed for
        durability: the record ring already holds them; for copying a live journal, say)."""
        w = self._writer
        return w is not None and w.barrier(self.config.sync_timeout_s if timeout is None else timeout)

    @_failsafe()
    def flush_ring(self, reason: str = "") -> int:
        """Write the full logits of the last ``ring`` steps now; returns how many were written."""
        if not self.config.ring or not self._ring:
            return 0
        items = [(step, e) for step, e in self._ring if e.device_copy is not None or e.host is not None]
        self._ring.clear()
        self._staging.wait_for_side()  # the ring's device copies are made on the side stream
        for step, e in items:
            rjob = self._side_job()
            if e.device_copy is not None:
                t, e.device_copy = e.device_copy, None
                self._staging.copy_out(rjob, e, t, t.numel() * t.element_size())
            elif rjob is not None and e.host is not None:
                e = self._staging.entries(rjob, None, [(e.name, e.kind, e.host, True)])[0]
            job = Job(kind=FrameKind.LOGITS, body={"step": step, "reason": reason}, groups={"tensors": [e]})
            self._stage_device(None, job, rjob)
            self._send(job, rjob)
        return len(items)

    def close(self, status: str = "ok", *, uncaught: str | None = None) -> None:
        """Write the ring and the end marker, stop the writer and seal this rank's file.
        ``uncaught``: the error the program ended on, kept in the end marker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._disabled:
            try:
                for hook in self.before_close:
                    try:
                        hook(self)
                    except Exception as e:  # noqa: BLE001 - what a hook adds is not worth the recording
                        log.warning("at the recording's close: %s: %s (recording goes on)", e.__class__.__name__, e)
                with self._lock:
                    if self._cur is not None:  # whichever thread began it
                        self._end(error="the program ended inside this step")
                self.flush_ring("exit")
                body: dict[str, Any] = {"ended_at": time.time(), "status": status, "steps": self._step_counter}
                if uncaught or self.uncaught:
                    body["uncaught"] = uncaught or self.uncaught
                if self._rr is not None:
                    body["ring"] = self.ring_stats()
                    if self._rr.full_waits or self._dropped:
                        self.note(f"record ring: {self._rr.full_waits} waits for room ({self._rr.full_wait_s:.3f} s), "
                                  f"{len(self._dropped)} steps dropped")
                self._post(Job(kind=FrameKind.CLOSE, body=body), wait=True)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
        w = self._writer
        if w is not None and self._disabled:
            self._mark_stopped(w)
        elif w is not None and w.stop(timeout=self.config.sync_timeout_s):
            w.journal.close()
            self._close_ring(w)  # drained: the journal holds everything
            try:
                # Still holding this rank's lock: `replay record`, sealing what its command left
                # behind, must not seal the same journal at the same time.
                seal_rank(self.part_dir, self.config.rank, force=True)
            except Exception as e:  # noqa: BLE001
                log.warning("could not seal rank %d (%s); its journal is kept and readable", self.config.rank, e)
        if w is not None and not w.alive():
            w.journal.close()
        self._close_ring(w)
        self._release_lock()

    def ring_stats(self) -> dict[str, Any]:
        """The record ring's size, its full-ring policy, the waits for room and the dropped steps."""
        r = self._rr
        if r is None:
            return self._ring_final or {"enabled": False}
        return {"enabled": True, "bytes": r.capacity, "policy": self.config.ring_full, "full_waits": r.full_waits,
                "full_wait_s": round(r.full_wait_s, 6), "dropped_steps": len(self._dropped), "dropped": self._dropped[:100],
                "cuda_registered": r.registered}

    def _close_ring(self, w: Writer | DrainProcess | None) -> None:
        """Remove the ring once the drain has stopped (what it held is in the journal, or the
        journal ends with why recording stopped); a stuck drain leaves it for ``replay seal``."""
        if self._rr is None:
            return
        self._ring_final = self.ring_stats()  # what the ring did, still readable after close
        ring, self._rr = self._rr, None
        self._ring_finalizer.detach()
        if w is not None and w.alive():
            return
        if w is not None and not ring.forked:
            ring_pointer(w.journal.journal_path).unlink(missing_ok=True)
        ring.close(unlink=True)

    def _mark_stopped(self, w: Writer | DrainProcess) -> None:
        """End the journal with why recording stopped, so that readers do not take it for a crash."""
        try:
            if not w.stop(timeout=2.0):
                return  # the writer is stuck (a hung filesystem): leave the journal as it is
            if isinstance(w, DrainProcess) and w.crashed:
                self._salvage_here(w)
            body = {"ended_at": time.time(), "status": "stopped", "error": self.error, "steps": self._step_counter}
            w.journal.release_reserve()  # on a full disk, the room for this frame
            w.journal.write_frame(FrameKind.CLOSE, body, over_budget=True)
        except Exception:  # noqa: BLE001 - a full disk cannot take this frame either; the journal stays readable
            pass

    def _salvage_here(self, w: DrainProcess) -> None:
        """A drain process that was killed left steps in the ring: they are as durable as the
        journal's, so they go into it before the end marker (this process holds the lock)."""
        try:
            salvage_ring(w.journal.journal_path, w.journal.payload_path)
            w.journal.refresh_sizes()
        except Exception as e:  # noqa: BLE001 - the ring stays for `replay seal`
            log.warning("could not move the record ring of rank %d into its journal (%s)", self.config.rank, e)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
            self._lock_fd = None
