"""The majority vote: which ranks agree with the most, and which are the odd ones out.

One rule everywhere (``info``, ``report``, ``bisect``): the largest group of equal values wins;
ties go to the group holding the lowest rank. ``vote`` answers for one value per rank;
``vote_columns`` for many columns at once (the report's ranks x steps map), vectorised.
"""

from __future__ import annotations

import numpy as np

__all__ = ["majority_text", "vote", "vote_columns"]


def vote_columns(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Per column of ``values`` ``[R, S]`` (``present``: which entries exist), the row index of a
    rank in the winning group: the lowest rank of the largest group of equal present values."""
    r, s = values.shape
    first = np.argmax(present, axis=0)
    ref = np.where(present.any(0), first, 0)
    if r < 2 or not s:
        return ref
    cols = np.flatnonzero(~((values == values[ref, np.arange(s)]) | ~present).all(0))
    for lo in range(0, cols.size, 4096):
        c = cols[lo : lo + 4096]
        v, p = values[:, c], present[:, c]
        # [R, R, n]: O(R^2) per disagreeing column only; agreeing columns were settled above.
        eq = (v[:, None, :] == v[None, :, :]) & p[:, None, :] & p[None, :, :]
        ref[c] = np.argmax(eq.sum(1), axis=0)  # argmax takes the lowest rank of the largest group
    return ref


def vote(values: dict[int, int]) -> tuple[list[int], list[int]]:
    """(majority, odd ones out) of one value per rank, by the rule of ``vote_columns``."""
    if not values:
        return [], []
    ranks = sorted(values)
    ids: dict[int, int] = {}
    column = np.array([[ids.setdefault(values[r], len(ids))] for r in ranks], dtype=np.int64)  # [R, 1]
    win = column[int(vote_columns(column, np.ones_like(column, dtype=bool))[0]), 0]
    return [r for r, v in zip(ranks, column[:, 0]) if v == win], [r for r, v in zip(ranks, column[:, 0]) if v != win]


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs))


def majority_text(odd: list[int], majority: list[int], groups: int) -> str:
    """What the ranks named odd are odd against: a true majority ("majority: 0, 1, 3"), or, when
    the largest group holds half the ranks or fewer, that there is none (``groups``: how many
    distinct values the ranks hold) and which rule named the odd ones."""
    total = len(odd) + len(majority)
    if 2 * len(majority) > total:
        return f"majority: {_ranks(majority)}"
    if total == 2:
        return f"against rank {_ranks(majority)}: two ranks cannot outvote each other"
    if groups == 2 and len(majority) == len(odd):
        return f"no majority: ranks {_ranks(majority)} and {_ranks(odd)} split evenly; named: the group without rank {min(majority + odd)}"
    return (f"no majority: {groups} different values among {total} ranks; named: the ranks outside rank "
            f"{min(majority)}'s group")
