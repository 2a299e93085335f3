"""The write-ahead journal a rank writes while it records.

Why a journal and not HDF5 directly: an HDF5 file being written when its process is SIGKILLed can
be left unreadable as a whole. A journal is append-only: a kill can only cut its last frame short,
and the reader stops at the first frame that is not whole. Tensor bytes go to a second
append-only file, the payload, *before* the frame that refers to them, so a whole frame always
points at bytes that were written. Both writes are plain ``write`` calls into the page cache,
which outlives the process: a kill (as opposed to a power cut) loses nothing that was written.
Sealing (``replay.format.seal``) turns the frames into an HDF5 index over the same payload file,
without copying the payload.

Frame layout (little-endian)::

    magic  b"RJF1"   4 bytes
    kind   uint16    FrameKind
    flags  uint16    0
    length uint32    body length in bytes
    crc32  uint32    zlib.crc32 of the body
    body   UTF-8 JSON object
"""

from __future__ import annotations

import enum
import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from replay.format import perms as _perms  # issue 16
from replay.format.prealloc import reserve as _reserve_blocks

__all__ = [
    "FrameKind",
    "Frame",
    "JournalWriter",
    "JournalScan",
    "read_journal",
    "scan_journal",
    "MAX_FRAME_BYTES",
]

MAGIC = b"RJF1"
_HEADER = struct.Struct("<4sHHII")
# A bound on one frame's body, so a damaged or hostile length field cannot make the reader
# allocate gigabytes.
MAX_FRAME_BYTES = 64 << 20


class FrameKind(enum.IntEnum):
    HEADER = 1
    STEP = 2
    GRAPH = 3
    COLLECTIVE = 4
    KEYFRAME = 5
    LOGITS = 6
    TUNER = 7
    NOTE = 8
    CLOSE = 9
    REPLAY = 10
    TARGET = 11


@dataclass(slots=True)
class Frame:
    kind: FrameKind
    body: dict[str, Any]
    offset: int


class JournalWriter:
    """Appends payload bytes and frames for one rank. Not thread-safe: one writer thread owns it."""

    def __init__(self, journal_path: Path, payload_path: Path, *, max_bytes: int | None = None) -> None:
        self.journal_path = journal_path
        self.payload_path = payload_path
        self.max_bytes = max_bytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        # O_EXCL: two processes that believe they are the same rank must not interleave frames.
        self._jfd = _perms.open_new(journal_path, flags)  # issue 16: owner-only unless widened
        try:
            self._pfd = _perms.open_new(payload_path, flags)  # issue 16: owner-only unless widened
        except BaseException:
            os.close(self._jfd)
            raise
        self.payload_size = 0
        self.journal_size = 0
        self.reserve_path: Path | None = reserve_path(journal_path)
        try:
            _write_reserve(self.reserve_path)
        except OSError:
            self.reserve_path = None  # the disk is nearly full already: record without a reserve

    @classmethod
    def append_to(cls, journal_path: Path, payload_path: Path, *, valid_bytes: int) -> "JournalWriter":
        """Reopen a dead writer's journal to append to it (ring salvage): a frame cut short at
        its end is dropped first, or it would hide every frame written after it."""
        self = cls.__new__(cls)
        self.journal_path, self.payload_path, self.max_bytes = journal_path, payload_path, None
        flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        self._jfd = os.open(journal_path, flags)
        try:
            self._pfd = os.open(payload_path, flags) if payload_path.exists() else _perms.open_new(payload_path, flags)
        except BaseException:
            os.close(self._jfd)
            raise
        os.ftruncate(self._jfd, valid_bytes)
        self.journal_size = valid_bytes
        self.payload_size = os.fstat(self._pfd).st_size
        self.reserve_path = None
        return self

    def refresh_sizes(self) -> None:
        """Take both files' sizes from the files: another writer (the drain process, or the
        recording process for a job outside the ring) may have appended since."""
        self.payload_size = os.fstat(self._pfd).st_size
        self.journal_size = os.fstat(self._jfd).st_size

    def release_reserve(self) -> None:
        """Free the reserve: on a full disk, the room for the end marker that says so."""
        path, self.reserve_path = self.reserve_path, None
        if path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass

    @property
    def total_bytes(self) -> int:
        return self.payload_size + self.journal_size

    def _check_budget(self, n: int) -> None:
        if self.max_bytes is not None and self.total_bytes + n > self.max_bytes:
            raise OSError(28, f"recording size limit of {self.max_bytes} bytes reached")

    def write_payload(self, data: memoryview | bytes) -> int:
        """Append raw bytes to the payload file; return their offset."""
        view = memoryview(data).cast("B")
        self._check_budget(view.nbytes)
        offset = self.payload_size
        _reserve_blocks(self._pfd, offset, view.nbytes)
        try:
            _write_all(self._pfd, view)
        except OSError:
            self._rollback_payload(offset)
            raise
        self.payload_size += view.nbytes
        return offset

    def write_payloads(self, views: list[memoryview]) -> int:
        """Append several buffers with one system call (``writev``); return the first offset."""
        views = [memoryview(v).cast("B") for v in views if memoryview(v).nbytes]
        total = sum(v.nbytes for v in views)
        self._check_budget(total)
        offset = self.payload_size
        _reserve_blocks(self._pfd, offset, total)
        try:
            while views:
                n = os.writev(self._pfd, views[:1024])  # IOV_MAX
                self.payload_size += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        except OSError:
            self._rollback_payload(offset)
            raise
        return offset

    def _rollback_payload(self, size: int) -> None:
        # A write cut short (a full disk) leaves the file at its last whole write, so that what
        # is written next (the end marker) starts where the readers expect.
        self.payload_size = size
        _truncate(self._pfd, size)

    def write_frame(self, kind: FrameKind, body: dict[str, Any], *, over_budget: bool = False) -> None:
        """Append one frame. ``over_budget``: the small end marker that says why recording
        stopped is written even past ``max_bytes``, or readers would take the stop for a crash."""
        self.write_frames([(kind, body)], over_budget=over_budget)

    def write_frames(self, frames: list[tuple[FrameKind, dict[str, Any]]], *, over_budget: bool = False) -> None:
        """Append several frames in one write call (a drain that took several jobs at once)."""
        self.write_encoded(encode_frames(frames), over_budget=over_budget)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes stay within ``max_bytes``."""
        return self.max_bytes is None or self.total_bytes + n <= self.max_bytes

    def write_encoded(self, data: bytes, *, over_budget: bool = False) -> None:
        """Append frames made by ``encode_frames``, in one write call."""
        if not over_budget:
            self._check_budget(len(data))
        # One write call: a kill leaves the frames whole, the last perhaps cut short, never
        # interleaved with another writer's.
        try:
            _write_all(self._jfd, memoryview(data))
        except OSError:
            # Part of a frame on disk would hide every later frame (the end marker) from readers.
            _truncate(self._jfd, self.journal_size)
            raise
        self.journal_size += len(data)

    def sync(self) -> None:
        os.fsync(self._pfd)
        os.fsync(self._jfd)

    def close(self) -> None:
        """Close both files; safe to call twice (a second ``os.close`` of a number could close
        an unrelated file that reused it)."""
        self.release_reserve()
        fds, self._pfd, self._jfd = (self._pfd, self._jfd), -1, -1
        for fd in fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass


# Room kept beside each live journal (a file of zeros, so that the blocks are really taken): when
# the disk fills, the recorder frees it to write the end marker that says why recording stopped.
# Sealing removes the reserve of a process that was killed.
RESERVE_BYTES = 64 << 10


def reserve_path(journal_path: Path) -> Path:
    return journal_path.with_suffix(".reserve")


def _write_reserve(path: Path) -> None:
    fd = _perms.open_new(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))  # issue 16: mode
    try:
        _write_all(fd, memoryview(bytes(RESERVE_BYTES)))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _truncate(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass  # the reader drops a cut-short tail anyway


def encode_frames(frames: list[tuple[FrameKind, dict[str, Any]]]) -> bytes:
    """Frames as the journal holds them: for each, its header (magic, kind, length, CRC-32) and
    its JSON body."""
    parts = []
    for kind, body in frames:
        raw = json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
        if len(raw) > MAX_FRAME_BYTES:
            raise ValueError(f"journal frame of {len(raw)} bytes exceeds {MAX_FRAME_BYTES}")
        parts += (_HEADER.pack(MAGIC, int(kind), 0, len(raw), zlib.crc32(raw)), raw)
    return b"".join(parts)


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


@dataclass(slots=True)
class JournalScan:
    frames: list[Frame]
    valid_bytes: int  # bytes of whole frames
    total_bytes: int  # bytes in the file
    problem: str | None  # why the scan stopped early, None when the file ended on a frame boundary

    @property
    def truncated(self) -> bool:
        return self.valid_bytes < self.total_bytes


def read_journal(path: Path) -> JournalScan:
    """Read every whole frame of a journal; stop at the first one that is cut short or damaged."""
    frames: list[Frame] = []
    scan = scan_journal(path, frames.append)
    scan.frames = frames
    return scan


def scan_journal(path: Path, on_frame: Callable[[Frame], None]) -> JournalScan:
    """Hand every whole frame of a journal to ``on_frame`` as it is read (``frames`` is left
    empty): sealing a long run this way never holds all its frames at once.

    The file is read frame by frame, never whole, and only up to the size it had when opened:
    a live journal gives a consistent prefix, and a huge or sparse file cannot blow up memory.
    """
    pos = 0
    problem: str | None = None
    # O_NONBLOCK: opening a FIFO put where a journal should be must not block forever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))  # issue 16: no links
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{Path(path).name} is not a regular file")
    with os.fdopen(fd, "rb") as fh:
        n = st.st_size
        while pos < n:
            head = fh.read(_HEADER.size) if n - pos >= _HEADER.size else b""
            if len(head) < _HEADER.size:
                problem = f"last frame cut short at byte {pos}"
                break
            magic, kind, _flags, length, crc = _HEADER.unpack(head)
            if magic != MAGIC:
                problem = f"no frame marker at byte {pos}"
                break
            if length > MAX_FRAME_BYTES:
                problem = f"frame at byte {pos} claims {length} bytes"
                break
            end = pos + _HEADER.size + length
            if end > n:
                problem = f"last frame cut short at byte {pos}"
                break
            body = fh.read(length)
            if len(body) < length:
                problem = f"last frame cut short at byte {pos}"
                break
            if zlib.crc32(body) != crc:
                problem = f"checksum mismatch in frame at byte {pos}"
                break
            try:
                kind_e = FrameKind(kind)
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                # RecursionError: a hostile body nested deeper than the parser's stack.
                problem = f"unreadable frame at byte {pos}"
                break
            if not isinstance(obj, dict):
                problem = f"unreadable frame at byte {pos}"
                break
            on_frame(Frame(kind_e, obj, pos))
            pos = end
    return JournalScan(frames=[], valid_bytes=pos, total_bytes=n, problem=problem)
