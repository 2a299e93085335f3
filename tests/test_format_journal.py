"""`replay.format.journal`: frames that survive a kill, payload bytes before the frames that point at
them, and a reader that stops at the first frame that is not whole."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from replay.format.journal import MAX_FRAME_BYTES, FrameKind, JournalWriter, read_journal, scan_journal


def _writer(tmp_path: Path, **kw) -> JournalWriter:
    return JournalWriter(tmp_path / "rank-00000.journal", tmp_path / "rank-00000.payload", **kw)


def test_frames_and_payload_round_trip(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    a = w.write_payload(b"abcd")
    b = w.write_payloads([memoryview(b"ef"), memoryview(b""), memoryview(b"ghij")])
    w.write_frame(FrameKind.HEADER, {"rank": 0})
    w.write_frame(FrameKind.STEP, {"step": 0, "offset": b, "note": "ü \u202e"})
    w.close()
    w.close()  # twice is safe
    assert (a, b) == (0, 4) and (tmp_path / "rank-00000.payload").read_bytes() == b"abcdefghij"
    scan = read_journal(w.journal_path)
    assert scan.problem is None and not scan.truncated and scan.valid_bytes == scan.total_bytes
    assert [(f.kind, f.body) for f in scan.frames] == [(FrameKind.HEADER, {"rank": 0}),
                                                       (FrameKind.STEP, {"step": 0, "offset": 4, "note": "ü \u202e"})]
    assert scan.frames[0].offset == 0 and scan.frames[1].offset > 0
    seen = []
    assert scan_journal(w.journal_path, seen.append).frames == [] and len(seen) == 2  # streamed, not kept


def _two_frames(tmp_path: Path) -> tuple[Path, int]:
    w = _writer(tmp_path)
    w.write_frame(FrameKind.HEADER, {"rank": 0})
    first = w.journal_size
    w.write_frame(FrameKind.STEP, {"step": 0})
    w.close()
    return w.journal_path, first


@pytest.mark.parametrize("damage, problem", [
    ("cut-body", "last frame cut short"),
    ("cut-header", "last frame cut short"),
    ("flip-body-byte", "checksum mismatch"),
    ("bad-magic", "no frame marker"),
    ("huge-length", "claims"),
], ids=["cut-body", "cut-header", "flip-body-byte", "bad-magic", "huge-length"])
def test_reader_keeps_the_whole_frames_before_damage(tmp_path: Path, damage: str, problem: str) -> None:
    path, first = _two_frames(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "cut-body":
        raw = raw[:-3]
    elif damage == "cut-header":
        raw = raw[: first + 5]
    elif damage == "flip-body-byte":
        raw[-2] ^= 0x01
    elif damage == "bad-magic":
        raw[first : first + 4] = b"XXXX"
    elif damage == "huge-length":
        raw[first + 8 : first + 12] = struct.pack("<I", MAX_FRAME_BYTES + 1)
    path.write_bytes(bytes(raw))
    scan = read_journal(path)
    assert [f.kind for f in scan.frames] == [FrameKind.HEADER]  # the whole first frame is kept
    assert scan.valid_bytes == first and scan.truncated and problem in (scan.problem or "")


def test_a_valid_frame_of_an_unknown_kind_or_not_an_object_stops_the_scan(tmp_path: Path) -> None:
    path, first = _two_frames(tmp_path)
    for kind, body in [(99, b'{"a":1}'), (int(FrameKind.STEP), b"[1,2]")]:
        raw = path.read_bytes()[:first] + struct.pack("<4sHHII", b"RJF1", kind, 0, len(body), zlib.crc32(body)) + body
        path.write_bytes(raw)
        scan = read_journal(path)
        assert len(scan.frames) == 1 and "unreadable frame" in (scan.problem or "")


def test_size_limit_refuses_writes_past_it_except_the_end_marker(tmp_path: Path) -> None:
    w = _writer(tmp_path, max_bytes=64)
    w.write_payload(b"x" * 40)
    with pytest.raises(OSError, match="size limit"):
        w.write_payload(b"y" * 40)
    assert w.payload_size == 40  # the refused write left nothing behind
    w.write_frame(FrameKind.CLOSE, {"stopped": "size limit"}, over_budget=True)
    w.close()
    assert [f.body for f in read_journal(w.journal_path).frames] == [{"stopped": "size limit"}]


def test_a_second_writer_for_the_same_rank_is_refused(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    with pytest.raises(FileExistsError):
        _writer(tmp_path)  # two processes that think they are rank 0 must not interleave frames
    w.close()


def test_reserve_is_kept_while_live_and_freed_on_close(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    assert w.reserve_path is not None and w.reserve_path.stat().st_size > 0
    reserve = w.reserve_path
    w.close()
    assert not reserve.exists()


def test_a_fifo_is_not_read_as_a_journal(tmp_path: Path) -> None:
    fifo = tmp_path / "rank-00000.journal"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_journal(fifo)  # returns at once: opening a FIFO must not block


def test_large_payloads_reserve_blocks_without_changing_what_the_file_holds(tmp_path: Path) -> None:
    """Payloads of 1 MiB and more have their blocks reserved before the write (as
    ``numpy.tofile`` does; ``replay.format.prealloc``): the payload file must still hold exactly
    the bytes appended, in order, with its size theirs, and a writer appending after it (the
    drain process, then the recording process) must land right after them."""
    from replay.format import prealloc

    big = [bytes([i]) * (prealloc.MIN_BYTES + 4096 * i) for i in range(3)]
    w = JournalWriter(tmp_path / "r.journal", tmp_path / "r.payload")
    offsets = [w.write_payloads([memoryview(big[0]), memoryview(b"small")]), w.write_payload(big[1])]
    w.write_frame(FrameKind.STEP, {"step": 0})
    w.close()
    again = JournalWriter.append_to(tmp_path / "r.journal", tmp_path / "r.payload", valid_bytes=os.path.getsize(tmp_path / "r.journal"))
    offsets.append(again.write_payload(big[2]))
    again.close()
    data = (tmp_path / "r.payload").read_bytes()
    assert data == big[0] + b"small" + big[1] + big[2]
    assert offsets == [0, len(big[0]) + 5, len(big[0]) + 5 + len(big[1])]
    fd = os.open(tmp_path / "r.payload", os.O_RDONLY)
    try:
        assert prealloc.reserve(fd, 0, 10) is False  # small: nothing to do
    finally:
        os.close(fd)
