"""The first divergence across ranks, found from the per-step field digests alone.

Only the summary tables are read (never tensor payloads), one array per rank, and the search is
vectorised: the cost is a sort of all (step, field) keys, so 8 ranks x 100,000 steps take well
under a second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from replay.format.reader import Part, RankFile

__all__ = ["Divergence", "first_divergence", "vote"]

_ABSENT = np.uint64(0)


@dataclass(slots=True)
class Divergence:
    """Where ranks first disagree: the step, the field, and the odd ranks out."""

    step: int
    field: str
    ranks: list[int]  # the odd ones out
    majority: list[int]  # the ranks in the largest group
    digests: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "field": self.field,
            "ranks": self.ranks,
            "majority": self.majority,
            "digests": {str(r): f"{d:016x}" for r, d in sorted(self.digests.items())},
        }

    def __str__(self) -> str:
        odd = ", ".join(map(str, self.ranks))
        return f"step {self.step}: {self.field} differs on rank{'s' if len(self.ranks) > 1 else ''} {odd}"


def vote(values: dict[int, int]) -> tuple[list[int], list[int]]:
    """(majority, odd ones out). Ties go to the group holding the lowest rank."""
    counts = Counter(values.values())
    best = max(counts.values())
    winners = [v for v, c in counts.items() if c == best]
    win = min(winners, key=lambda v: min(r for r, x in values.items() if x == v))
    majority = sorted(r for r, v in values.items() if v == win)
    odd = sorted(r for r, v in values.items() if v != win)
    return majority, odd


def _keys(rf: RankFile, names: dict[str, int], prefix: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, digest, order) of a rank's fields; key = step * 2**20 + global field id."""
    t = rf.tables
    f = t.fields
    lut = np.full(len(t.strings) + 1, -1, dtype=np.int64)
    for i in np.unique(f["field"]):
        s = t.string(int(i))
        if prefix is not None and not s.startswith(prefix):
            continue
        lut[int(i)] = names.setdefault(s, len(names))
    gid = lut[np.clip(f["field"], -1, len(t.strings))]
    keep = gid >= 0
    step = f["step"][keep].astype(np.int64)
    key = (step << 20) | gid[keep]
    return key, f["digest"][keep], f["order"][keep].astype(np.int64)


def first_divergence(
    part: Part, *, prefix: str | None = None, ranks: Iterable[int] | None = None
) -> Divergence | None:
    """The first (step, field) at which the ranks' digests disagree.

    ``prefix`` limits the fields compared (``"tokens."`` for the first token divergence).
    A step a rank never reached is not a disagreement: it is left out for that rank.
    """
    chosen = sorted(ranks) if ranks is not None else list(part)
    if len(chosen) < 2:
        return None
    names: dict[str, int] = {}
    per_rank = {r: _keys(part[r], names, prefix) for r in chosen}
    all_keys = np.unique(np.concatenate([k for k, _, _ in per_rank.values()]))
    if all_keys.size == 0:
        return None
    n = all_keys.size
    ref = np.zeros(n, dtype=np.uint64)
    have_ref = np.zeros(n, dtype=bool)
    differs = np.zeros(n, dtype=bool)
    order = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    last_step = {r: (int(part[r].tables.steps["step"].max()) if part[r].tables.steps.size else -1) for r in chosen}
    key_step = all_keys >> 20
    aligned: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r in chosen:
        k, d, o = per_rank[r]
        idx = np.searchsorted(all_keys, k)
        present = np.zeros(n, dtype=bool)
        present[idx] = True
        dig = np.zeros(n, dtype=np.uint64)
        dig[idx] = d
        np.minimum.at(order, idx, o)
        # A field absent at a step this rank did record is a disagreement (e.g. an extra
        # collective); absent beyond its last step is not.
        missing = ~present & (key_step <= last_step[r])
        newref = present & ~have_ref
        ref[newref] = dig[newref]
        have_ref |= present
        differs |= (present & (dig != ref)) | missing
        aligned[r] = (present, dig)
    # Any rank missing a field that others have where the reference was set later: recheck.
    if not differs.any():
        return None
    cand = np.flatnonzero(differs)
    first = cand[np.lexsort((order[cand], key_step[cand]))[0]]
    gid = int(all_keys[first] & ((1 << 20) - 1))
    fname = next(s for s, i in names.items() if i == gid)
    values: dict[int, int] = {}
    for r in chosen:
        present, dig = aligned[r]
        if present[first]:
            values[r] = int(dig[first])
        elif key_step[first] <= last_step[r]:
            values[r] = -1  # the field is missing on this rank
    majority, odd = vote(values)
    return Divergence(
        step=int(key_step[first]),
        field=fname,
        ranks=odd,
        majority=majority,
        digests={r: v for r, v in values.items() if v >= 0},
    )
