"""Sealing: turn a rank's journal into its HDF5 index, atomically and without copying the payload.

A journal is sealed by the recorder itself when it closes cleanly, and by ``replay record`` for
every rank its command left behind, however it ended. Sealing never touches what was recorded:
it writes ``rank-NNNNN.h5.tmp``, renames it into place, and only then removes the journal. A
journal that a live process still holds (``fcntl.flock``) is never sealed.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from replay.format.h5 import write_rank_file
from replay.format.journal import read_journal
from replay.format.schema import parse_rank_stem
from replay.format.tables import build_tables

__all__ = ["SealResult", "seal_rank", "seal_part", "journal_is_live", "rank_paths"]


@dataclass(slots=True)
class SealResult:
    rank: int
    path: Path
    steps: int
    complete: bool
    problem: str | None  # why the journal ended early (a kill mid-frame), if it did
    lost_bytes: int


def rank_paths(part_dir: Path, rank: int) -> tuple[Path, Path, Path]:
    stem = f"rank-{rank:05d}"
    return part_dir / f"{stem}.journal", part_dir / f"{stem}.payload", part_dir / f"{stem}.h5"


def journal_is_live(journal: Path) -> bool:
    """True while the recording process that owns ``journal`` is alive (it holds a lock on it)."""
    try:
        fd = os.open(journal, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def seal_rank(part_dir: Path, rank: int, *, force: bool = False) -> SealResult | None:
    """Seal one rank's journal. Returns None when there is nothing to seal (or it is live)."""
    journal, payload, h5 = rank_paths(part_dir, rank)
    if not journal.exists():
        return None
    if not force and journal_is_live(journal):
        return None
    scan = read_journal(journal)
    payload_size = payload.stat().st_size if payload.exists() else 0
    tables = build_tables(scan.frames, payload_size=payload_size)
    tables.attrs["sealed_from_journal"] = True
    if scan.problem:
        tables.attrs["journal_problem"] = scan.problem
        tables.attrs["lost_bytes"] = scan.total_bytes - scan.valid_bytes
    if not payload.exists():
        payload.touch()
    tmp = h5.with_name(h5.name + ".tmp")
    tmp.unlink(missing_ok=True)
    write_rank_file(tables, tmp, payload.name)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, h5)
    journal.unlink()
    return SealResult(
        rank=rank,
        path=h5,
        steps=int(tables.steps.size),
        complete=bool(tables.attrs.get("complete")),
        problem=scan.problem,
        lost_bytes=scan.total_bytes - scan.valid_bytes,
    )


def seal_part(part_dir: Path) -> list[SealResult]:
    """Seal every journal of a part whose process has ended."""
    results = []
    for j in sorted(part_dir.glob("rank-*.journal")):
        rank = parse_rank_stem(j.stem)
        if rank is None:
            continue
        r = seal_rank(part_dir, rank)
        if r is not None:
            results.append(r)
    return results
