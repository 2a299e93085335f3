"""Salvage a killed rank's record ring into its journal (``replay seal``, ``replay record``'s parent).

A recording rank writes each step's record into a ring in ``/dev/shm`` (``replay.record.ring``
describes the layout) and a drain thread moves whole records to the journal. A SIGKILL leaves the
ring file behind, with the records the drain had not reached yet. Salvage walks the ring from the
drain's tail, takes every whole job (its commit word equals its expected commit) not already in
the journal (frames carry the ring sequence number ``rs``), appends its payload bytes and frame
to the journal, exactly as the drain would have, then removes the ring. It runs under the seal
lock, so never beside a live writer. Numpy only: no torch, no code from the recording runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from replay.format.journal import FrameKind, JournalWriter, scan_journal

__all__ = ["salvage_ring", "assemble_collectives", "RING_MAGIC", "JOB_MAGIC", "WRAP_MAGIC", "HEADER_BYTES",
           "JOB_HEADER_BYTES", "ring_pointer", "RING_NAME", "read_job", "build_frame"]

RING_MAGIC = b"RRNG0001"
JOB_MAGIC = 0x4A42524A  # "JRBJ"
WRAP_MAGIC = 0x50415257  # "WRAP"
HEADER_BYTES = 4096
JOB_HEADER_BYTES = 64
# Header words (int64 index into the ring's header page). H_STOP: the recording process asks a
# drain process (``replay.format.ring_drain``) to stop once nothing whole is left.
# H_WAITING: the recording process waits for room now (the drain should not sleep long).
# H_WAKEABLE: the drain process set it once a signal (``ring_drain.WAKE_SIGNAL``) can cut its
# sleep short, and not before (the signal's default action would end it).
H_CAPACITY, H_TAIL_POS, H_TAIL_SEQ, H_RANK, H_STOP, H_WAITING, H_WAKEABLE = 1, 2, 3, 4, 5, 6, 7
# The only file names a pointer may name: salvage removes the file afterwards.
RING_NAME = re.compile(r"replay-\d+-[0-9a-f]{12}\.ring")
_MASK64 = (1 << 64) - 1
# Stored tensors up to this size are kept by a drain to notice when their bytes repeat.
_REPEAT_BYTES = 1 << 20


def ring_pointer(journal_path: Path) -> Path:
    """The file beside a journal naming its ring (``rank-NNNNN.ring``)."""
    return Path(journal_path).with_suffix(".ring")


def _ring_path(pointer: Path) -> Path | None:
    try:
        text = pointer.read_text(encoding="utf-8", errors="strict").strip()
    except (OSError, UnicodeDecodeError):
        return None
    p = Path(text)
    if not p.is_absolute() or not RING_NAME.fullmatch(p.name):
        return None
    return p


def salvage_ring(journal: Path, payload: Path) -> int | None:
    """Append the whole jobs left in ``journal``'s ring; returns how many (None: no ring)."""
    pointer = ring_pointer(journal)
    if not pointer.exists():
        return None
    ring = _ring_path(pointer)
    n = 0
    if ring is not None and ring.exists():
        n = _salvage(journal, payload, ring)
        ring.unlink(missing_ok=True)
    pointer.unlink(missing_ok=True)
    return n


def _salvage(journal: Path, payload: Path, ring: Path) -> int:
    fd = os.open(ring, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES + (1 << 20):
            return 0
        import mmap

        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        if bytes(buf[:8]) != RING_MAGIC:
            return 0
        head = buf[:HEADER_BYTES].view(np.int64)
        cap = int(head[H_CAPACITY])
        if cap <= 0 or cap % 64 or HEADER_BYTES + cap > st.st_size:
            return 0
        data = buf[HEADER_BYTES : HEADER_BYTES + cap]
        done = {"rs": -1, "closed": False}

        def seen(f: Any) -> None:
            rs = f.body.get("rs")
            if isinstance(rs, int):
                done["rs"] = max(done["rs"], rs)
            if f.kind == FrameKind.CLOSE:
                done["closed"] = True

        scan = scan_journal(journal, seen)
        if done["closed"] or scan.valid_bytes == 0:
            return 0  # closed: nothing after the end marker; no header: nothing to append to
        jobs = list(_walk(data, cap, int(head[H_TAIL_POS]), int(head[H_TAIL_SEQ])))
        jobs = [j for j in jobs if j[0] > done["rs"]]
        if not jobs:
            return 0
        w = JournalWriter.append_to(journal, payload, valid_bytes=scan.valid_bytes)
        try:
            for seq, meta in jobs:
                frame = _frame(data, seq, meta, base=w.payload_size)
                if frame is None:
                    break
                kind, body, views = frame
                if views:
                    w.write_payloads(views)
                w.write_frame(kind, body)
        finally:
            w.close()
        return len(jobs)
    finally:
        del buf, head, data
        try:
            mm.close()
        except BufferError:
            pass


def _walk(data: np.ndarray, cap: int, pos: int, seq: int):  # noqa: ANN202 - yields (seq, meta)
    """The whole jobs from the tail on, in order; stops at the first that is not whole."""
    limit = pos + 2 * cap
    while pos < limit:
        got = read_job(data, cap, pos, seq)
        if got is None:
            return
        if got[0] == "wrap":
            pos = got[1]
            continue
        _, jseq, meta, end = got
        if meta.get("x"):
            return  # some bytes of this job were never in the ring: the walk ends here
        yield jseq, meta
        seq = jseq + 1
        pos = end


def read_job(data: np.ndarray, cap: int, pos: int, seq: int) -> tuple[Any, ...] | None:
    """What lies at virtual position ``pos`` when job ``seq`` is due there: ``("job", seq, meta,
    end)`` for a whole job (its meta with the kind under ``"k"``), ``("wrap", next)`` for the
    wrap word that skips the rest of a lap, or None (nothing whole there yet)."""
    phys = pos % cap
    word = int(data[phys : phys + 4].view(np.uint32)[0])
    if word == WRAP_MAGIC:
        return ("wrap", pos + cap - phys)
    if word != JOB_MAGIC or phys + JOB_HEADER_BYTES > cap:
        return None
    h = [int(x) for x in data[phys : phys + JOB_HEADER_BYTES].view(np.int64)]
    kind = h[0] >> 32
    jseq, meta_pos, meta_len, end, crc_flags, expected, commit = h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    if jseq < seq or commit != expected or expected == 0:
        return None
    if not pos < meta_pos < end <= pos + cap or meta_len <= 0 or meta_pos % cap + meta_len > cap:
        return None
    mp = meta_pos % cap
    raw = bytes(data[mp : mp + meta_len])
    if zlib.crc32(raw) != (crc_flags & 0xFFFFFFFF):
        return None
    try:
        meta = json.loads(raw)
        FrameKind(kind)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    meta["k"] = kind
    return ("job", jseq, meta, end)


def _np_dtype(name: str) -> np.dtype | None:
    if name == "bfloat16":
        return None
    try:
        return np.dtype(name)
    except TypeError:
        return None


def floats_at(data: np.ndarray, at: int, dtype: str, shape: list[int]) -> np.ndarray:
    """``shape`` values of ``dtype`` at byte ``at`` of ``data``, as float32 (bfloat16 included)."""
    n = math.prod(shape)
    if dtype == "bfloat16":
        raw = data[at : at + 2 * n].view(np.uint16).astype(np.uint32) << np.uint32(16)
        return raw.view(np.float32).reshape(shape)
    dt = _np_dtype(dtype)
    assert dt is not None
    return data[at : at + dt.itemsize * n].view(dt).reshape(shape).astype(np.float32)


def margin_of(x: np.ndarray) -> float:
    """The top-1/top-2 margin, as the recorder computes it (float32, minimum over rows).

    As ``replay.record.margin.device_margin``: each row's largest value, then the largest of the
    rest once that slot is masked (ties, infinities and NaN give what ``topk`` gives). Three
    passes over the logits instead of ``np.partition``'s (5.6x faster on 4 MiB here: the drain
    computes this for every CPU step). ``x`` is left as it was (its masked slots are restored)."""
    x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    if x.size == 0 or x.shape[-1] < 2:
        return math.nan  # no row, or no second value: no margin (a job naming one is not the recorder's)
    if not x.flags.writeable:
        x = x.copy()
    rows = np.arange(x.shape[0])
    idx = x.argmax(axis=-1)
    top1 = x[rows, idx]
    x[rows, idx] = -np.inf
    try:
        top2 = x.max(axis=-1)
    finally:
        x[rows, idx] = top1
    with np.errstate(invalid="ignore"):  # inf - inf, NaN: the margin is NaN, as on the device
        return float((top1 - top2).min())


def _frame(data: np.ndarray, seq: int, meta: dict[str, Any], *, base: int) -> tuple[FrameKind, dict[str, Any], list[memoryview]] | None:
    return build_frame(data, seq, meta, base=base)


def build_frame(data: np.ndarray, seq: int, meta: dict[str, Any], *, base: int,
                last: dict[tuple[int, str], tuple[Any, ...]] | None = None) -> tuple[FrameKind, dict[str, Any], list[memoryview]] | None:
    """A job's frame body and payload bytes (stored from payload offset ``base`` on); None when
    some of its bytes are not in the ring. ``last``: the drain's record of the last stored bytes
    of each small tensor, so that bytes that repeat (RNG state, page tables) point at their
    earlier copy instead of being written again."""
    body = dict(meta.get("b") or {})
    d = meta.get("d")
    digests = data[d[0] : d[0] + 8 * d[1]].view(np.int64) if d else None
    groups = [(gname, [_Row(data, row, digests, last) for row in entries]) for gname, entries in (meta.get("g") or {}).items()]
    rows = [r for _, g in groups for r in g]
    if any(r.missing for r in rows):
        return None  # bytes the ring does not hold (they went to the writer)
    _digest_rows(rows)
    views: list[memoryview] = []
    off = base
    for gname, g in groups:
        refs = []
        for r in g:
            ref, off = r.ref(views, off, last)
            refs.append(ref)
        body[gname] = refs
    _finish(data, body, meta)
    body["rs"] = seq
    return FrameKind(meta["k"]), body, views


class _Row:
    """One tensor of a job: its bytes in the ring (if any), its digest once known, and whether
    its stored bytes repeat the drain's last copy of it."""

    __slots__ = ("name", "kind", "dtype", "shape", "store", "nbytes", "arr", "dig", "prev", "missing")

    def __init__(self, data: np.ndarray, row: list[Any], digests: np.ndarray | None,
                 last: dict[tuple[int, str], tuple[Any, ...]] | None) -> None:
        name, kind, dtype, shape, store, at, nbytes, dig, slot = row
        self.name, self.kind, self.dtype, self.shape, self.store, self.nbytes = name, kind, dtype, shape, store, int(nbytes)
        self.arr = arr = data[at : at + nbytes] if at >= 0 else None
        if dig is None and slot >= 0 and digests is not None:
            dig = f"{int(digests[slot]) & _MASK64:016x}"
        self.prev = None
        if store and arr is not None and last is not None and _repeats(last.get((kind, name)), dtype, shape, arr):
            self.prev = last[(kind, name)]
            dig = self.prev[4]
        self.dig = dig
        # No digest and no bytes to make it from, or stored bytes that are not in the ring.
        self.missing = (dig is None and arr is None) or (store and arr is None)

    def ref(self, views: list[memoryview], off: int,
            last: dict[tuple[int, str], tuple[Any, ...]] | None) -> tuple[dict[str, Any], int]:
        """The frame's reference to this tensor, its stored bytes appended to ``views``; and the
        payload offset after them."""
        ref: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "dig": self.dig}
        if self.prev is not None:
            ref["off"], ref["n"] = self.prev[3], self.nbytes
            return ref, off
        if self.store:
            ref["off"], ref["n"] = off, self.nbytes
            if self.nbytes:
                views.append(memoryview(self.arr))
                if last is not None and self.nbytes <= _REPEAT_BYTES:
                    last[(self.kind, self.name)] = (self.dtype, list(self.shape), self.arr.copy(), off, self.dig)
            off += self.nbytes
        return ref, off


def _digest_rows(rows: list[_Row]) -> None:
    """The digests a job's rows lack, from their bytes in the ring, in one vectorised pass (a
    numpy call per tensor cost the drain ~10 calls a step, tens of µs each with cold caches)."""
    from replay.digest import digest_numpy_many

    todo = [r for r in rows if r.dig is None]
    if todo:
        for r, dig in zip(todo, digest_numpy_many([r.arr for r in todo])):
            r.dig = f"{dig:016x}"


def _repeats(prev: tuple[Any, ...] | None, dtype: str, shape: list[int], arr: np.ndarray) -> bool:
    """The same bytes as the last stored copy of this tensor (``prev``), of the same dtype and shape."""
    return prev is not None and prev[0] == dtype and prev[1] == list(shape) and prev[2].nbytes == arr.nbytes \
        and prev[2].tobytes() == arr.tobytes()


def _finish(data: np.ndarray, body: dict[str, Any], meta: dict[str, Any]) -> None:
    """What the drain computes once the bytes are in: the margin, the accepted count, collectives."""
    fin = meta.get("f") or {}
    if meta.get("m", -1) >= 0:
        body["margin"] = float(data[meta["m"] : meta["m"] + 4].view(np.float32)[0])
    if "margin" in fin:
        at, dtype, shape = fin["margin"]
        body["margin"] = margin_of(floats_at(data, at, dtype, shape))
    if "acc" in fin:
        at, dtype, shape, nbytes = fin["acc"]
        dt = _np_dtype(dtype)
        if dt is not None:
            body["accepted"] = int(data[at : at + nbytes].view(dt).astype(np.int64).sum())
    if "coll" in fin:
        colls = assemble_collectives(body, fin["coll"])
        if fin.get("single"):
            body.update(colls[0])
        else:
            body["collectives"] = colls


def assemble_collectives(body: dict[str, Any], meta: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collectives of a frame from their staged input/output refs (``_cin*``/``_cout*``)."""
    from replay.format.tables import combine_digests

    out = []
    for i, c in enumerate(meta):
        ins = body.pop(f"_cin{i}", [])
        outs = body.pop(f"_cout{i}", [])
        d = dict(c)
        d["in"] = f"{combine_digests(int(r['dig'], 16) for r in ins):016x}"
        d["out"] = f"{combine_digests(int(r['dig'], 16) for r in outs):016x}"
        stored = [r for r in outs if "off" in r]
        d["out_ref"] = stored[0] if len(stored) == 1 else None
        if len(stored) > 1:
            d["out_refs"] = stored
        out.append(d)
    return out


def live_ring_steps(journal: Path) -> list[int]:
    """The step indices of whole step records in a journal's ring, read-only (the rank may still
    be recording): what a reader of a live journal cannot see yet but a kill would not lose."""
    ring = _ring_path(ring_pointer(journal))
    if ring is None:
        return []
    try:
        fd = os.open(ring, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES + (1 << 20):
            return []
        import mmap

        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        if bytes(buf[:8]) != RING_MAGIC:
            return []
        head = buf[:HEADER_BYTES].view(np.int64)
        cap = int(head[H_CAPACITY])
        if cap <= 0 or cap % 64 or HEADER_BYTES + cap > st.st_size:
            return []
        data = buf[HEADER_BYTES : HEADER_BYTES + cap]
        steps = []
        for _seq, meta in _walk(data, cap, int(head[H_TAIL_POS]), int(head[H_TAIL_SEQ])):
            body = meta.get("b") or {}
            if meta.get("k") == int(FrameKind.STEP) and isinstance(body.get("step"), int):
                steps.append(body["step"])
        return steps
    finally:
        del buf, head
        try:
            mm.close()
        except BufferError:
            pass
