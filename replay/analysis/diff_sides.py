"""What ``replay diff A B`` compares: a recording, one part of it, or one rank of a part.

A side is written ``PATH[:PART[/RANK]]`` (``recA``, ``recA:run-000``, ``recA:run-000/3``), or as
the path of a part directory or of one rank file. Opening a side reads nothing but the directory
listing and the manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from replay.errors import OutOfRange, RecordingNotFound, UsageError
from replay.format.reader import Part, RankFile, Recording
from replay.format.schema import parse_rank_stem

__all__ = ["Side", "SideSpec", "parse_side", "open_side", "open_sides"]

_TAIL = re.compile(r"^(?P<part>[A-Za-z0-9_.-]*)(?:/(?P<rank>\d+))?$")


@dataclass(kw_only=True, slots=True, frozen=True)
class SideSpec:
    """A side as the user wrote it: the recording's path, and optionally a part and a rank."""

    path: Path
    part: str | None = None
    rank: int | None = None


def parse_side(text: str) -> SideSpec:
    """``recA:run-000/3`` -> SideSpec(recA, run-000, 3). A path that exists as written wins over
    a ``:`` split, so a directory whose name holds a colon still works."""
    if not text:
        raise UsageError("an empty recording name: give PATH, PATH:PART or PATH:PART/RANK")
    if Path(text).exists() or ":" not in text:
        return _from_path(Path(text))
    head, tail = text.rsplit(":", 1)
    m = _TAIL.match(tail)
    if m is None or not head:
        raise UsageError(f"{text!r} is not PATH, PATH:PART or PATH:PART/RANK (e.g. recA:run-000/3)")
    base = _from_path(Path(head))
    part = m.group("part") or base.part
    rank = int(m.group("rank")) if m.group("rank") is not None else base.rank
    return SideSpec(path=base.path, part=part, rank=rank)


def _from_path(p: Path) -> SideSpec:
    """A recording directory, a part directory inside one, or one rank file of a part."""
    if not p.exists():
        raise RecordingNotFound(f"no recording at {p}: give the directory `replay record` wrote")
    if p.is_file():
        r = parse_rank_stem(p.stem)
        if r is None or p.suffix not in (".h5", ".journal"):
            raise UsageError(f"{p} is a file, not a recording: give the recording directory (or PATH:PART/RANK)")
        return SideSpec(path=p.parent.parent, part=p.parent.name, rank=r)
    if any(parse_rank_stem(f.stem) is not None for f in p.glob("rank-*.*")):
        return SideSpec(path=p.parent, part=p.name)
    return SideSpec(path=p)


@dataclass(slots=True)
class Side:
    """One side of a diff: the part, and the ranks of it that are compared."""

    label: str  # "A" or "B"
    text: str  # as the user wrote it
    recording: Recording
    part: Part
    ranks: list[int]
    rank_given: bool

    @property
    def files(self) -> list[RankFile]:
        return [self.part[r] for r in self.ranks]

    def describe(self) -> str:
        which = f"rank {self.ranks[0]}" if self.rank_given else f"{len(self.ranks)} rank{'s' if len(self.ranks) != 1 else ''}"
        return f"{self.recording.path}:{self.part.name} ({which})"


def open_side(text: str, label: str) -> Side:
    spec = parse_side(text)
    return _side(spec, text, label, Recording(spec.path))


def open_sides(a: str, b: str) -> tuple[list[tuple[Side, Side]], list[str], list[str]]:
    """The pairs of parts to compare: one pair, or, when A and B are both whole recordings of
    several parts (a pytest session: one part per test), every part name they share.
    Returns (pairs, parts in A only, parts in B only)."""
    sa, sb = parse_side(a), parse_side(b)
    ra, rb = Recording(sa.path), Recording(sb.path)
    if sa.part is None and sb.part is None and sa.rank is None and sb.rank is None and len(ra) > 1 and len(rb) > 1:
        if _task_pool(ra) or _task_pool(rb):
            return _pool_pairs(sa, sb, a, b, ra, rb)
        common = [n for n in ra if n in rb]
        if not common:
            raise UsageError(f"{sa.path} and {sb.path} have no part name in common: name one of each, e.g. "
                             f"{a}:{next(iter(ra))} {b}:{next(iter(rb))}")
        pairs = [(_side(SideSpec(path=sa.path, part=n), a, "A", ra), _side(SideSpec(path=sb.path, part=n), b, "B", rb))
                 for n in common]
        return pairs, [n for n in ra if n not in rb], [n for n in rb if n not in ra]
    return [(_side(sa, a, "A", ra), _side(sb, b, "B", rb))], [], []


def _target(part: Part) -> dict:
    try:
        rf = part[min(part)]
        t = rf.attrs.get("target")
    except Exception:  # noqa: BLE001 - a part that cannot be read pairs with nothing
        return {}
    return t if isinstance(t, dict) else {}


def _task_pool(rec: Recording) -> bool:
    """Parts recorded in a task pool's workers (``multiprocessing.Pool``, ``ProcessPoolExecutor``)."""
    return any((_target(p).get("launch") or {}).get("task_pool") for p in rec.values())


def _weights_key(part: Part) -> tuple | None:
    w = _target(part).get("weights")
    if not isinstance(w, dict) or not w:
        return None
    return tuple(sorted((str(n), str(v.get("digest"))) for n, v in w.items() if isinstance(v, dict)))


def _pool_pairs(sa: SideSpec, sb: SideSpec, a: str, b: str, ra: Recording, rb: Recording
                ) -> tuple[list[tuple[Side, Side]], list[str], list[str]]:
    """Parts of a task pool, paired by their model's weights: a part's name follows which worker
    took which task, and in what order, which changes from run to run. Parts whose models have
    the same weights cannot be told apart that way: the user names them."""
    keys_a = {n: _weights_key(p) for n, p in ra.items()}
    keys_b = {n: _weights_key(p) for n, p in rb.items()}
    unique_a = [k for k in keys_a.values() if k is not None and list(keys_a.values()).count(k) == 1]
    unique_b = {k: n for n, k in keys_b.items() if k is not None and list(keys_b.values()).count(k) == 1}
    if len(unique_a) != len(keys_a) or len(unique_b) != len(keys_b):
        raise UsageError(f"{sa.path} and {sb.path} were recorded in a task pool (multiprocessing.Pool, ProcessPoolExecutor), "
                         "whose part names follow which worker took which task, and some of their parts' models have the "
                         "same weights, so the parts of one task cannot be paired: name one of each, e.g. "
                         f"{a}:{next(iter(ra))} {b}:{next(iter(rb))}")
    by_key = {k: n for n, k in keys_a.items()}
    pairs = [(_side(SideSpec(path=sa.path, part=na), a, "A", ra), _side(SideSpec(path=sb.path, part=unique_b[k]), b, "B", rb))
             for k, na in by_key.items() if k in unique_b]
    if not pairs:
        raise UsageError(f"{sa.path} and {sb.path} were recorded in a task pool, and no part of one has a model with the "
                         f"weights of a part of the other: name one of each, e.g. {a}:{next(iter(ra))} {b}:{next(iter(rb))}")
    return pairs, [n for k, n in by_key.items() if k not in unique_b], [n for k, n in unique_b.items() if k not in by_key]


def _side(spec: SideSpec, text: str, label: str, rec: Recording) -> Side:
    if spec.part is not None:
        part = rec[spec.part]
    elif len(rec) == 1:
        part = next(iter(rec.values()))
    else:
        names = list(rec)
        raise UsageError(
            f"{spec.path} has {len(names)} parts ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}): "
            f"name one, e.g. {text}:{names[0]}"
        )
    if spec.rank is not None:
        if spec.rank not in part:
            raise OutOfRange(f"{spec.path}:{part.name} has no rank {spec.rank} (ranks: {', '.join(map(str, part))})")
        ranks = [spec.rank]
    else:
        ranks = list(part)
    return Side(label=label, text=text, recording=rec, part=part, ranks=ranks, rank_given=spec.rank is not None)
