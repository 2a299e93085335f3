"""The agreement map: per rank and step, the most severe way the rank differs from the majority.

Each rank's field digests are folded, per step, into one digest per field category (graph,
inputs, collectives, outputs, tokens); one majority vote (``replay.analysis.vote``, the vote
``info`` and ``bisect`` use) over the non-token categories, and one over tokens, name the odd
ranks; the cell says which category differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.analysis.vote import vote_columns
from replay.format.reader import Part
from replay.format.schema import StepStatus

__all__ = ["CELL_LABELS", "Cell", "RankSteps", "agreement", "align", "bin_max", "unique"]


class Cell:
    """What one (rank, step) cell of the agreement map says, by increasing severity."""

    MISSING = -1  # the rank recorded no such step
    AGREE = 0
    GRAPH = 1  # ran another graph (or eager) than the majority, same numbers
    INPUT = 2  # inputs differ (usually fed back from an earlier divergence)
    COLLECTIVE = 3  # a collective's output differs
    OUTPUT = 4  # output bits differ, tokens agree
    TOKENS = 5  # sampled/accepted tokens differ
    RAISED = 6  # the step raised


CELL_LABELS: dict[int, str] = {
    Cell.MISSING: "not recorded",
    Cell.AGREE: "agrees",
    Cell.GRAPH: "other graph / eager",
    Cell.INPUT: "inputs differ",
    Cell.COLLECTIVE: "collective differs",
    Cell.OUTPUT: "output bits differ",
    Cell.TOKENS: "tokens differ",
    Cell.RAISED: "step raised",
}

# Field name prefix -> (category index, the cell code it gives when it differs).
_CATEGORIES: list[tuple[str, int]] = [
    ("graph", Cell.GRAPH),
    ("input.", Cell.INPUT),
    ("collective.", Cell.COLLECTIVE),
    ("output.", Cell.OUTPUT),
    ("", Cell.OUTPUT),  # anything else a newer recorder adds counts as an output
    ("tokens.", Cell.TOKENS),
]
_TOKENS = len(_CATEGORIES) - 1
_OTHER = len(_CATEGORIES) - 2

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the output (uint64, wraps)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _category(name: str) -> int:
    if name == "graph":
        return 0
    for i, (prefix, _) in enumerate(_CATEGORIES):
        if i != 0 and prefix and name.startswith(prefix):
            return i
    return _OTHER


@dataclass(slots=True)
class RankSteps:
    """One rank's steps laid on the common step axis (``idx``: positions in it)."""

    rank: int
    idx: np.ndarray
    rows: np.ndarray  # /steps rows, sorted by step
    cat: np.ndarray  # [C, S] uint64 combined digests per field category (0: absent)
    strings: Any


def align(part: Part) -> tuple[np.ndarray, list[RankSteps]]:
    tables = {r: part[r].tables for r in part}
    all_steps = [t.steps["step"] for t in tables.values() if t.steps.size]
    steps = unique(np.concatenate(all_steps)) if all_steps else np.zeros(0, np.int64)
    names: dict[str, int] = {}
    out = []
    for r, t in tables.items():
        rows = np.sort(t.steps, order="step", kind="stable")
        idx = np.searchsorted(steps, rows["step"])
        out.append(RankSteps(r, idx, rows, _field_digests(t, steps, names), t))
    return steps, out


def unique(a: np.ndarray, *, inverse: bool = False) -> Any:
    """Sorted unique values (and the inverse map) by one sort: cheaper than np.unique's hashing here."""
    order = np.argsort(a, kind="stable")
    srt = a[order]
    first = np.ones(srt.size, dtype=bool)
    first[1:] = srt[1:] != srt[:-1]
    uniq = srt[first]
    if not inverse:
        return uniq
    inv = np.empty(a.size, dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    return uniq, inv


def _field_digests(t: Any, steps: np.ndarray, names: dict[str, int]) -> np.ndarray:
    """[C, S] per step and field category: an order-sensitive sum of mixed field digests."""
    c, s = len(_CATEGORIES), int(steps.size)
    f = t.fields
    out = np.zeros(c * s, dtype=np.uint64)
    if not f.size or not s:
        return out.reshape(c, s)
    ids = np.flatnonzero(np.bincount(np.clip(f["field"], 0, None)))
    gid = np.full(int(ids.max()) + 1, 0, dtype=np.uint64)
    cat = np.full(int(ids.max()) + 1, _OTHER, dtype=np.int64)
    for i in ids:
        name = t.string(int(i))
        gid[int(i)] = names.setdefault(name, len(names) + 1)
        cat[int(i)] = _category(name)
    fid = np.clip(f["field"], 0, None)
    pos = np.searchsorted(steps, f["step"])
    pos = np.clip(pos, 0, s - 1)
    with np.errstate(over="ignore"):
        key = gid[fid] * np.uint64(0x9E3779B97F4A7C15) + f["order"].astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)
        mixed = _mix(f["digest"] ^ _mix(key)) | np.uint64(1)  # never 0: 0 means "absent"
    np.add.at(out, cat[fid] * s + pos, mixed)
    return out.reshape(c, s)


def agreement(per_rank: list[RankSteps], steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([R, S] int8 cell codes, steps where any rank differs, steps where tokens differ)."""
    r, s = len(per_rank), int(steps.size)
    present = np.zeros((r, s), dtype=bool)
    raised = np.zeros((r, s), dtype=bool)
    for i, rs in enumerate(per_rank):
        present[i, rs.idx] = True
        raised[i, rs.idx] = rs.rows["status"] == StepStatus.RAISED
    cats = np.stack([rs.cat for rs in per_rank]) if per_rank else np.zeros((0, len(_CATEGORIES), s), np.uint64)
    cells = np.where(present, Cell.AGREE, Cell.MISSING).astype(np.int8)
    if not r or not s:
        return cells, np.zeros(0, np.int64), np.zeros(0, np.int64)
    cols = np.arange(s)
    # One vote on everything but tokens, then name the most severe category that differs from
    # the majority's; tokens get their own vote (what users compare first).
    body = [c for c in range(len(_CATEGORIES)) if c != _TOKENS]
    with np.errstate(over="ignore"):
        total = np.zeros((r, s), dtype=np.uint64)
        for c in body:
            total += _mix(cats[:, c, :] + np.uint64(c + 1))
    ref = vote_columns(total, present)
    differs = present & (total != total[ref, cols])
    for c in body:
        code = _CATEGORIES[c][1]
        d = differs & (cats[:, c, :] != cats[ref, c, cols])
        cells = np.where(d & (cells < code), code, cells).astype(np.int8)
    tok = cats[:, _TOKENS, :]
    tref = vote_columns(tok, present)
    tdiff = present & (tok != tok[tref, cols])
    cells[tdiff] = Cell.TOKENS
    cells[raised] = Cell.RAISED
    return cells, steps[(differs | tdiff).any(0)], steps[tdiff.any(0)]


def bin_max(a: np.ndarray, edges: np.ndarray) -> np.ndarray:
    if a.shape[1] == 0:
        return a
    return np.maximum.reduceat(a, edges[:-1], axis=1)
