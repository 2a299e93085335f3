"""The per-rank record ring: a file in ``/dev/shm`` mapped ``MAP_SHARED`` that outlives the process.

Why: a step's record must be durable the moment the step is done, without the step waiting for a
writer. Bytes stored into a shared mapping of a tmpfs file stay in the kernel's page cache when
the process is SIGKILLed, so whatever the host has written there (and whatever the GPU has copied
there, once the mapping is registered with ``cudaHostRegister``) survives the process. A drain
thread moves whole records to the journal at its own pace; a killed rank's ring is salvaged into
its journal by ``replay seal`` / ``replay record``'s parent (``replay.format.ring_salvage``).

Layout of the file (little-endian)::

    header, 4096 bytes: magic b"RRNG0001", then int64 words (see ``H_*``): capacity, tail position,
                        tail sequence number, rank
    data, ``capacity`` bytes: a byte ring of 64-byte aligned allocations

Positions are virtual (they only grow); a position's place in the data area is ``pos % capacity``.
Each job (a step, a keyframe, a note: anything that becomes a journal frame) starts with a 64-byte
job header, then its data allocations, then its meta (JSON: the frame body and where each tensor's
bytes lie). An allocation never straddles the end of the data area: the rest of the lap is
skipped, marked by a wrap word. Job header (int64 words)::

    0 magic | kind << 32     1 seq     2 meta position    3 meta length
    4 end position           5 crc32 of the meta | device-commit flag << 32
    6 expected commit        7 commit (written last: by the host, or by the device: a stream write or a copy)

A job is whole when its commit word equals its expected commit; the walk from the tail stops at
the first job that is not.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

# The layout's constants live with its reader (salvage), which must not import torch.
from replay.format.ring_salvage import (  # noqa: F401 - re-exported
    H_CAPACITY,
    H_RANK,
    H_TAIL_POS,
    H_TAIL_SEQ,
    H_WAITING,
    HEADER_BYTES,
    JOB_HEADER_BYTES,
    JOB_MAGIC,
    RING_MAGIC,
    WRAP_MAGIC,
    ring_pointer,
)

__all__ = ["ShmRing", "RingFull", "ring_pointer", "JOB_HEADER_BYTES", "COMMIT_OFFSET"]

COMMIT_OFFSET = 7 * 8  # the commit word's byte offset in a job header (word 7, above)
_WORD = struct.Struct("=q")  # native order, as the readers' numpy views
_FIELDS = struct.Struct("=6q")  # words 1..6 of a job header

ALIGN = 64


class RingFull(Exception):
    """No room in the ring and the policy is ``drop``."""


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


FORKED = "the recorder was inherited by a forked process: it records in the process that created it"


class ShmRing:
    """One rank's ring. The host allocates and writes; the drain (a thread or a process) frees
    from the tail."""

    def __init__(self, directory: str, capacity: int, *, rank: int) -> None:
        capacity = max(align(capacity), 1 << 20)
        self.capacity = capacity
        self.path = Path(directory) / f"replay-{os.getpid()}-{secrets.token_hex(6)}.ring"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            # Take the pages now: on a full tmpfs a store into a sparse mapping is a SIGBUS in
            # the program, this is an ENOSPC here.
            os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
            # MAP_POPULATE maps every page now (about 80 ms for 64 MiB on the 2-core CI machine, once
            # a rank): else the host's copies fault on each page of the ring's first lap, which
            # doubles what a step's CPU tensors cost.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, HEADER_BYTES + capacity, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.head_words = self.buf[:HEADER_BYTES].view(np.int64)
        self.buf[:8] = np.frombuffer(RING_MAGIC, dtype=np.uint8)
        self.head_words[H_CAPACITY] = capacity
        self.head_words[H_RANK] = rank
        self.data = self.buf[HEADER_BYTES:]
        self.data_tensor = None  # a torch view of ``data``, made on first use
        self.registered = False
        self.head = 0  # next free virtual position (host)
        self._tail = 0  # oldest position still in use (drain)
        # The tail as last read: it only moves forward, so room counted from it is never more
        # than there is; ``alloc`` reads the tail again only when that room is too little (a
        # read of a drain process's tail is a numpy access, ~2 µs, several times a step).
        self._seen_tail = 0
        self.tail_seq = 0
        # A drain process moves the tail in the header (``replay.record.drain``): read it there,
        # and wait for room by polling, asking ``alive_check`` (raises) whether it still runs.
        self.remote_tail = False
        self.alive_check: Any = None
        self.full_waits = 0
        self.full_wait_s = 0.0
        self.waiting = 0  # host threads waiting for room now: the drain must not hold a step back
        self.on_full: Any = None  # called when the host starts waiting (wakes the drain)
        # Set in a process forked from this one: the mapping is shared with the parent, whose
        # record it is; the child must neither write it nor remove it.
        self.forked = False
        _rings.add(self)
        self._cond = threading.Condition()

    @property
    def tail(self) -> int:
        """The oldest position still in use (everything before it is in the journal)."""
        if self.remote_tail and self.head_words is not None:
            return int(self.head_words[H_TAIL_POS])
        return self._tail

    # -- host side -------------------------------------------------------------------------

    def torch_data(self):  # noqa: ANN201 - torch.Tensor, imported lazily
        if self.data_tensor is None:
            import torch

            with torch.inference_mode(False):  # written in place by steps in and out of inference mode
                self.data_tensor = torch.from_numpy(self.data)
        return self.data_tensor

    def register_cuda(self) -> str | None:
        """Pin the mapping for the GPU's copy engines; returns why not, or None on success."""
        if self.registered:
            return None
        import torch

        try:
            cudart = torch.cuda.cudart()
            ptr = self.torch_data().data_ptr()
            err = cudart.cudaHostRegister(ptr, self.capacity, 0)
        except Exception as e:  # noqa: BLE001
            return f"{e.__class__.__name__}: {e}"
        code = int(getattr(err, "value", err))
        if code != 0:
            return f"cudaHostRegister returned error {code}"
        self.registered = True
        return None

    def free_bytes(self) -> int:
        return self.capacity - (self.head - self.tail)

    def alloc(self, n: int, *, block: bool, timeout: float) -> int:
        """Reserve ``n`` bytes; returns their offset in the data area. Raises RingFull (drop) or
        TimeoutError (block, the drain did not free room in ``timeout`` s)."""
        if self.forked:
            raise RuntimeError(FORKED)
        n = align(max(n, 1))
        if n > self.capacity // 2:
            raise ValueError(f"{n} bytes do not fit the record ring")
        phys = self.head % self.capacity
        skip = self.capacity - phys if phys + n > self.capacity else 0
        if self.head + skip + n - self._seen_tail > self.capacity:
            self._seen_tail = self.tail
            if self.head + skip + n - self._seen_tail > self.capacity:
                if not block:
                    raise RingFull
                self._wait_room(skip + n, timeout)
        if skip:
            self.data[phys : phys + 8].view(np.uint64)[0] = WRAP_MAGIC
            self.head += skip
            phys = 0
        self.head += n
        return phys

    def _wait_room(self, n: int, timeout: float) -> None:
        import time

        t0 = time.perf_counter()
        self.full_waits += 1
        self.waiting += 1
        try:
            if self.remote_tail:
                ok = self._poll_room(n, timeout)
            else:
                if self.on_full is not None:
                    self.on_full()
                with self._cond:
                    ok = self._cond.wait_for(lambda: self.head + n - self.tail <= self.capacity, timeout)
        finally:
            self.waiting -= 1
        self.full_wait_s += time.perf_counter() - t0
        if not ok:
            raise TimeoutError(f"the record ring stayed full for {timeout:.0f} s")

    def _poll_room(self, n: int, timeout: float) -> bool:
        """Wait for the drain process to free room: the step is held up anyway, so poll often
        (an oversleep here is time the drain may sit idle), and tell the drain we wait."""
        import time

        deadline = time.monotonic() + timeout
        self.head_words[H_WAITING] = 1
        if self.on_full is not None:
            self.on_full()  # the drain may be asleep for a while: wake it now
        try:
            while self.head + n - self.tail > self.capacity:
                if self.alive_check is not None:
                    self.alive_check()
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.00005)
        finally:
            self.head_words[H_WAITING] = 0
        return True

    def write_job_header(self, at: int, kind: int, seq: int, meta_at_pos: int, meta_len: int, end_pos: int,
                         crc: int, device_commit: bool, expected: int) -> None:
        # struct into the mapping: numpy views of it cost several µs a step on the program's
        # thread. The words in this order: the commit word cleared, the fields, the magic, and
        # (a host commit) the commit word last, so that a reader never takes a half-written job.
        mm, pos = self._mm, HEADER_BYTES + at
        _WORD.pack_into(mm, pos + COMMIT_OFFSET, 0)
        _FIELDS.pack_into(mm, pos + 8, seq, meta_at_pos, meta_len, end_pos, crc | (int(device_commit) << 32), expected)
        _WORD.pack_into(mm, pos, JOB_MAGIC | (kind << 32))
        if not device_commit:
            _WORD.pack_into(mm, pos + COMMIT_OFFSET, expected)  # last: the job is whole from here on

    def commit_view(self, at: int):  # noqa: ANN201 - a torch int64 view of the job's commit word
        import torch

        return self.torch_data()[at + COMMIT_OFFSET : at + COMMIT_OFFSET + 8].view(torch.int64)

    # -- drain side ------------------------------------------------------------------------

    def release(self, end_pos: int, next_seq: int) -> None:
        """Everything before ``end_pos`` is in the journal; ``next_seq`` is the next job to drain."""
        # The position first: a drain process that sees the new sequence number (it waits on it
        # for a job this process wrote) then reads the new position too (x86 keeps stores in order).
        self.head_words[H_TAIL_POS] = end_pos
        self.head_words[H_TAIL_SEQ] = next_seq
        with self._cond:
            self._tail = end_pos
            self.tail_seq = next_seq
            self._cond.notify_all()

    def close(self, *, unlink: bool) -> None:
        if self.forked:
            unlink = False
            self.registered = False  # (CUDA is not usable in a forked child anyway)
        if self.registered:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self.torch_data().data_ptr())
            except Exception:  # noqa: BLE001
                pass
            self.registered = False
        self.data_tensor = None
        self.data = self.buf = self.head_words = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with the process
        if unlink:
            self.path.unlink(missing_ok=True)


_rings: "weakref.WeakSet[ShmRing]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ring in list(_rings):
        ring.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)
