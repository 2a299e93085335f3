"""Collective inputs that differ across ranks where they should agree.

A collective hides the drift it carries: when one rank's logits drift before an ``all_reduce``,
or a rank samples another token before a ``broadcast`` from rank 0, every rank receives the same
bits and every field after it agrees. The recorder keeps each collective's input digest, so the
drift is still there to find. Not every input should agree: a tensor-parallel rank reduces its
own partial sum, and those differ at every step by design. A place in the step (its n-th
collective, of one op) whose inputs agree across the ranks at most of the steps where all of
them ran it carries a value every rank computes alike; a step where it differs is a divergence.
So is one whose inputs agreed at every step before (``AGREED_BEFORE`` steps at least) and then
differ: a mistake that persists once made (a rank that samples otherwise from step 5 on) differs
at most steps of a long enough run. Places whose inputs differ from the first steps on are
shards and are never called a divergence.

Only the collectives tables are read, one array per rank, vectorised.
"""

from __future__ import annotations

import numpy as np

from replay.format.reader import Part, RankFile

__all__ = ["INPUT_SUFFIX", "first_input_divergence", "first_input_difference", "rank_local_inputs"]

# A divergence's field: ``collective.<place>.<op>`` (the output field's name) and this suffix.
INPUT_SUFFIX = " input"
_PLACE_BITS = 20  # places within a step (a step makes fewer than 2**20 collectives)
# Steps a place's inputs agreed at, every one before the first that differs, for that first to be
# a divergence however many steps differ after it (one agreeing step could be chance: a shard of
# zeros at a prefill).
AGREED_BEFORE = 2


def _keyed(part: Part, rank: int, steps: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key = step << _PLACE_BITS | place, op string id, input digest) of the rank's collectives
    with a recorded input digest, sorted by key."""
    return _keyed_file(part[rank], steps)


def _keyed_file(rf: RankFile, steps: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = rf.collectives()
    if steps is not None:
        c = c[np.isin(c["step"], steps)]
    if not c.size:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.uint64)
    c = c[np.lexsort((c["ordinal"], c["step"]))]
    step = c["step"].astype(np.int64)
    first = np.searchsorted(step, step, side="left")
    place = np.arange(step.size, dtype=np.int64) - first  # its order within the step
    key = (step << _PLACE_BITS) | np.minimum(place, (1 << _PLACE_BITS) - 1)
    keep = c["in_digest"] != 0  # 0: no input digest recorded
    return key[keep], c["op"][keep].astype(np.int64), c["in_digest"][keep]


def first_input_difference(files: list[tuple[RankFile, RankFile]]) -> tuple[int, int, str] | None:
    """Between two runs of one layout, rank against rank: (rank of A, step, field) of the first
    collective input that differs at a place (n-th collective of the step, one op) whose inputs
    agree between the runs at most steps, or at every step before; None when there is none.
    The collective hands every rank the same output: no field after it shows the change."""
    best: tuple[int, int, str] | None = None
    for ra, rb in files:
        ka, oa, da = _keyed_file(ra, None)
        kb, ob, db = _keyed_file(rb, None)
        common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
        if not common.size:
            continue
        agree = da[ia] == db[ib]
        if agree.all():
            continue
        names: dict[str, int] = {}
        op_a = _op_ids_of(ra, oa[ia], names)
        same_op = op_a == _op_ids_of(rb, ob[ib], names)
        place = common & ((1 << _PLACE_BITS) - 1)
        site = place * (len(names) + 1) + op_a
        hits = np.flatnonzero(~agree & same_op & np.isin(site, _agreeing_sites(site[same_op], agree[same_op])))
        if hits.size:
            i = int(hits[0])
            op = next(n for n, k in names.items() if k == int(op_a[i]))
            found = (ra.rank, int(common[i] >> _PLACE_BITS), f"collective.{int(place[i])}.{op}{INPUT_SUFFIX}")
            if best is None or found[1] < best[1]:
                best = found
    return best


def _op_ids_of(rf: RankFile, ops: np.ndarray, names: dict[str, int]) -> np.ndarray:
    """The rank file's op string ids as ids shared by every file compared (by name)."""
    u, inv = np.unique(ops, return_inverse=True)
    lut = np.array([names.setdefault(rf.tables.string(int(i)), len(names)) for i in u], dtype=np.int64)
    return lut[inv] if u.size else np.zeros(0, np.int64)


class _Compared:
    """The collectives every chosen rank ran (by step and place), their input digests side by
    side, and each one's site (its place in the step and its op)."""

    def __init__(self, part: Part, chosen: list[int], steps: np.ndarray | None) -> None:
        rows = {r: _keyed(part, r, steps) for r in chosen}
        common = rows[chosen[0]][0]
        for r in chosen[1:]:
            common = np.intersect1d(common, rows[r][0], assume_unique=True)
        self.common = common
        at = {r: np.searchsorted(rows[r][0], common) for r in chosen}
        self.digests = np.stack([rows[r][2][at[r]] for r in chosen]) if common.size else np.zeros((len(chosen), 0), np.uint64)
        self.agree = np.all(self.digests == self.digests[0], axis=0)
        self.names: dict[str, int] = {}
        self.ops = np.stack([_op_ids_of(part[r], rows[r][1][at[r]], self.names) for r in chosen]) if common.size \
            else np.zeros((len(chosen), 0), np.int64)
        self.same_op = np.all(self.ops == self.ops[0], axis=0)
        self.place = common & ((1 << _PLACE_BITS) - 1)
        self.site = self.place * (len(self.names) + 1) + self.ops[0]

    def field(self, i: int) -> str:
        op = next(n for n, k in self.names.items() if k == int(self.ops[0][i]))
        return f"collective.{int(self.place[i])}.{op}"

    def should_agree(self) -> np.ndarray:
        """Per collective: its site's inputs should agree (``_agreeing_sites``)."""
        return np.isin(self.site, _agreeing_sites(self.site[self.same_op], self.agree[self.same_op]))


def first_input_divergence(part: Part, chosen: list[int], steps: np.ndarray | None = None) -> tuple[int, str, dict[int, int]] | None:
    """(step, field, {rank: input digest}) of the first collective whose input differs across
    ``chosen`` ranks at a place whose inputs agree at most steps; None when there is none."""
    if len(chosen) < 2:
        return None
    c = _Compared(part, chosen, steps)
    if c.agree.all():
        return None
    hits = np.flatnonzero(~c.agree & c.same_op & c.should_agree())
    if not hits.size:
        return None
    i = int(hits[0])  # the first in (step, place) order
    return int(c.common[i] >> _PLACE_BITS), c.field(i) + INPUT_SUFFIX, {r: int(c.digests[k, i]) for k, r in enumerate(chosen)}


def rank_local_inputs(part: Part, chosen: list[int], steps: np.ndarray | None = None, *, limit: int = 8) -> list[str]:
    """The collectives (``collective.<place>.<op>``) whose inputs differ across ``chosen`` ranks
    at places where they should not agree: each rank's own shard (a tensor-parallel partial sum),
    never compared. What a "no divergence" verdict leaves out."""
    if len(chosen) < 2:
        return []
    c = _Compared(part, chosen, steps)
    out: dict[str, None] = {}
    for i in np.flatnonzero(~c.agree & ~(c.same_op & c.should_agree()))[:4096]:
        out[c.field(int(i))] = None
        if len(out) >= limit:
            break
    return list(out)


def _agreeing_sites(site: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """The sites (place and op) whose inputs should agree: they agree at most of their steps, or
    agreed at every step before the first that differs (``site``, ``agree``: one row a step, in
    step order)."""
    sites, which = np.unique(site, return_inverse=True)
    total = np.bincount(which, minlength=sites.size)
    agreed = np.bincount(which, weights=agree, minlength=sites.size)
    return np.union1d(sites[2 * agreed > total], _agreed_before(sites, which, agree))


def _agreed_before(sites: np.ndarray, which: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """The sites whose inputs agreed at their first ``AGREED_BEFORE`` steps or more, every one
    before the first that differs (``which``: each row's site, rows in step order)."""
    out = []
    for k in np.unique(which[~agree]):
        first_bad = int(np.argmax(~agree[which == k]))
        if first_bad >= AGREED_BEFORE:
            out.append(sites[k])
    return np.array(out, dtype=sites.dtype)

