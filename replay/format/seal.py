"""Sealing: turn a rank's journal into its HDF5 index, atomically and without copying the payload.

A journal is sealed by the recorder itself when it closes cleanly, and by ``replay record`` for
every rank its command left behind, however it ended. Sealing never touches what was recorded:
it writes ``rank-NNNNN.h5.<pid>.tmp``, renames it into place, and only then removes the journal.
A journal that a live process still holds (``fcntl.flock``) is never sealed, and a sealer holds
that lock while it seals, so two sealers never race.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from replay.format import perms
from replay.format.h5 import write_rank_file
from replay.format.journal import reserve_path, scan_journal
from replay.format.ring_salvage import salvage_ring  # issue 15
from replay.format.schema import parse_rank_stem
from replay.format.tables import TablesBuilder

__all__ = ["SealResult", "seal_rank", "seal_part", "journal_is_live", "rank_paths"]


@dataclass(slots=True)
class SealResult:
    rank: int
    path: Path
    steps: int
    complete: bool
    problem: str | None  # why the journal ended early (a kill mid-frame), if it did
    lost_bytes: int
    error: str | None = None  # why it could not be sealed (its journal is kept, still readable)
    signed: bool = False  # signed with this user's key (see replay/trust.py)


def rank_paths(part_dir: Path, rank: int) -> tuple[Path, Path, Path]:
    stem = f"rank-{rank:05d}"
    return part_dir / f"{stem}.journal", part_dir / f"{stem}.payload", part_dir / f"{stem}.h5"


def journal_is_live(journal: Path) -> bool:
    """True while the recording process that owns ``journal`` is alive (it holds a lock on it).

    A sealer holds the same lock while it seals, so a journal being sealed also reads as live.
    """
    try:
        # O_NONBLOCK: a FIFO where a journal should be must not block the reader.
        fd = os.open(journal, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _lock_for_sealing(journal: Path) -> int | None:
    """An fd holding the journal's exclusive lock, or None if its writer or another sealer has it.

    Two sealers (the recorder at exit and ``replay record`` after CMD, or two ``replay seal``)
    must not race: the loser would find the journal gone, or remove the winner's file.
    """
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The journal may have been sealed (and removed) between our open and our lock.
        if os.fstat(fd).st_ino != os.stat(journal).st_ino:
            raise FileNotFoundError(journal)
    except OSError:
        os.close(fd)
        return None
    return fd


def seal_rank(part_dir: Path, rank: int, *, force: bool = False, sign_after: float | None = None) -> SealResult | None:
    """Seal one rank's journal. Returns None when there is nothing to seal (or it is live).

    ``force``: the caller is the journal's own writer, which holds its lock; the sealed file is
    signed with this user's key (``replay.trust``): it names only what this process recorded.
    ``sign_after``: sign it too if the journal was last written at or after this time (a
    ``replay record`` sealing the ranks its own command left behind).
    """
    journal, payload, h5 = rank_paths(part_dir, rank)
    if not journal.exists():
        return None
    fd = None
    if not force:
        fd = _lock_for_sealing(journal)
        if fd is None:
            return None
    try:
        if h5.exists() and _holds_no_step(journal):
            # A rank file sealed already, and beside it a journal with no step: another writer's
            # that failed to start (its payload existed). Sealing it would replace the rank's
            # steps with none: it is left as it is, and said. (A journal with steps beside its
            # rank file is a sealer's killed between the two: sealed again, the same steps.)
            return SealResult(rank=rank, path=journal, steps=0, complete=False, problem=None, lost_bytes=0,
                              error=f"{h5.name} is sealed already: the journal beside it ({journal.stat().st_size} bytes, "
                                    "another writer's) was not sealed over it")
        try:
            written = os.stat(journal).st_mtime
        except OSError:
            written = 0.0
        sign = force or (sign_after is not None and written >= sign_after - 1.0)
        return _seal_locked(journal, payload, h5, rank, sign=sign)
    finally:
        if fd is not None:
            os.close(fd)


def _holds_no_step(journal: Path) -> bool:
    builder = TablesBuilder()
    try:
        scan_journal(journal, builder.add)
        return builder.finish(payload_size=0).steps.size == 0
    except Exception:  # noqa: BLE001 - a journal that cannot be read holds no step to seal either
        return True


def _seal_locked(journal: Path, payload: Path, h5: Path, rank: int, *, sign: bool = False) -> SealResult:
    # The reserve of a writer that is gone (killed, or closing): its room helps the seal fit.
    reserve_path(journal).unlink(missing_ok=True)
    salvage_ring(journal, payload)  # issue 15: a killed rank's record ring, into its journal
    builder = TablesBuilder()
    scan = scan_journal(journal, builder.add)
    payload_size = payload.stat().st_size if payload.exists() else 0
    tables = builder.finish(payload_size=payload_size)
    tables.attrs["sealed_from_journal"] = True
    if scan.problem:
        tables.attrs["journal_problem"] = scan.problem
        tables.attrs["lost_bytes"] = scan.total_bytes - scan.valid_bytes
    if not payload.exists():
        os.close(perms.open_new(payload, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)))
    # A name of our own: a sealer killed half-way leaves only its own temporary file behind.
    tmp = h5.with_name(f"{h5.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        write_rank_file(tables, tmp, payload.name)
        perms.set_file_mode(tmp)  # h5py creates with the umask's mode; a recording is the user's
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, h5)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    journal.unlink()
    signed = False
    if sign:
        from replay.trust import sign_rank

        signed = sign_rank(h5, tables.attrs.get("target"))
    return SealResult(
        rank=rank,
        path=h5,
        steps=int(tables.steps.size),
        complete=bool(tables.attrs.get("complete")),
        problem=scan.problem,
        lost_bytes=scan.total_bytes - scan.valid_bytes,
        signed=signed,
    )


def seal_part(part_dir: Path, *, sign_after: float | None = None) -> list[SealResult]:
    """Seal every journal of a part whose process has ended (``sign_after``: see ``seal_rank``).

    A journal that cannot be sealed (a full disk, an unwritable directory, a damaged header) is
    left as it is, still readable, and reported with ``error`` set: one bad rank never stops the
    others from being sealed.
    """
    results = []
    for j in sorted(part_dir.glob("rank-*.journal")):
        rank = parse_rank_stem(j.stem)
        if rank is None:
            continue
        try:
            r = seal_rank(part_dir, rank, sign_after=sign_after)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with one journal, the others are sealed
            r = SealResult(rank=rank, path=j, steps=0, complete=False, problem=None, lost_bytes=0, error=_describe(e))
        if r is not None:
            results.append(r)
    return results


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text[:200]
