"""One stream of a diff: a rank of run A against a rank of run B, step by step, field by field.

Only the summary tables are read (``/steps`` and ``/fields``); the work is vectorised over all
(step, field) rows, so 8 streams of 100,000 steps take well under a second. Tensors are read only
to say by how much a field differs (at the first difference) or whether it is within tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from replay.analysis.divergence import order_in_step
from replay.analysis.unshard import Missing, field_row
from replay.format.reader import RankFile
from replay.format.schema import StepStatus

from replay.analysis.diff_records import DiffOptions, DiffVerdict, FirstDifference, StreamDiff, StreamFacts

if TYPE_CHECKING:
    from replay.analysis.compare import Comparison

__all__ = ["FieldRows", "Names", "RowDiff", "field_rows", "diff_rows", "step_facts", "margin_at", "used_ids", "compare_stream", "within_tolerance"]

_SHIFT = 24  # (step << _SHIFT) | field id: one int64 key per row
_MAP_ALL_STRINGS = 4096


class Names:
    """Field names shared by every rank file of both runs (each file has its own string ids)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []

    def id(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


def used_ids(ids: np.ndarray) -> np.ndarray:
    """The distinct string ids in a column: a count over the (small) id range, faster than a sort."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    lo = int(ids.min())
    if lo < 0:
        return np.unique(ids)
    return np.flatnonzero(np.bincount(ids))


@dataclass(slots=True)
class FieldRows:
    """A rank's /fields rows in program order, with field names as shared ids."""

    step: np.ndarray  # int64
    gid: np.ndarray  # int64
    digest: np.ndarray  # uint64


def field_rows(rf: RankFile, names: Names, keep: Callable[[str], bool]) -> FieldRows:
    t = rf.tables
    f = t.fields
    lut = np.full(len(t.strings) + 1, -1, dtype=np.int64)
    # Few strings (the usual case): map them all, which costs nothing, instead of finding the
    # ids the column uses (a pass over every row). A string that names no field gets an id no
    # row carries.
    ids = range(len(t.strings)) if len(t.strings) <= _MAP_ALL_STRINGS else used_ids(f["field"])
    for i in ids:
        name = t.string(int(i))
        if keep(name):
            lut[int(i)] = names.id(name)
    gid = lut[f["field"]]
    steps, digests = f["step"].astype(np.int64, copy=False), f["digest"]
    if (gid < 0).any():
        ok = gid >= 0
        gid, steps, digests = gid[ok], steps[ok], digests[ok]
    return FieldRows(step=steps, gid=gid, digest=digests)


@dataclass(slots=True)
class RowDiff:
    """The (step, field) rows that differ, in program order: first step, then order in the step."""

    step: np.ndarray
    gid: np.ndarray
    digest_a: np.ndarray  # uint64; meaningless where not has_a
    digest_b: np.ndarray
    has_a: np.ndarray  # bool: the field was recorded at that step on A
    has_b: np.ndarray
    compared: int  # (step, field) rows present on both sides

    @property
    def size(self) -> int:
        return int(self.step.size)


def diff_rows(a: FieldRows, b: FieldRows, common_steps: np.ndarray) -> RowDiff:
    """Rows whose digests differ, and rows recorded on one side only at a step both recorded."""
    if a.step.size == b.step.size and np.array_equal(a.step, b.step) and np.array_equal(a.gid, b.gid):
        # Lockstep runs record the same fields in the same order: compare column-wise.
        idx = np.flatnonzero(a.digest != b.digest)
        ones = np.ones(idx.size, dtype=bool)
        return RowDiff(step=a.step[idx], gid=a.gid[idx], digest_a=a.digest[idx], digest_b=b.digest[idx],
                       has_a=ones, has_b=ones.copy(), compared=int(a.step.size))
    ka = (a.step << _SHIFT) | a.gid
    kb = (b.step << _SHIFT) | b.gid
    oa, ob = order_in_step(a.step), order_in_step(b.step)
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=False, return_indices=True)
    neq = a.digest[ia] != b.digest[ib]
    ia_d, ib_d = ia[neq], ib[neq]
    only_a = np.flatnonzero(~np.isin(ka, kb) & np.isin(a.step, common_steps))
    only_b = np.flatnonzero(~np.isin(kb, ka) & np.isin(b.step, common_steps))
    z = np.zeros
    step = np.concatenate([a.step[ia_d], a.step[only_a], b.step[only_b]])
    gid = np.concatenate([a.gid[ia_d], a.gid[only_a], b.gid[only_b]])
    order = np.concatenate([oa[ia_d], oa[only_a], ob[only_b]])
    dig_a = np.concatenate([a.digest[ia_d], a.digest[only_a], z(only_b.size, np.uint64)])
    dig_b = np.concatenate([b.digest[ib_d], z(only_a.size, np.uint64), b.digest[only_b]])
    has_a = np.concatenate([np.ones(ia_d.size + only_a.size, bool), z(only_b.size, bool)])
    has_b = np.concatenate([np.ones(ia_d.size, bool), z(only_a.size, bool), np.ones(only_b.size, bool)])
    srt = np.lexsort((order, step))
    return RowDiff(step=step[srt], gid=gid[srt], digest_a=dig_a[srt], digest_b=dig_b[srt],
                   has_a=has_a[srt], has_b=has_b[srt], compared=int(ia.size))


def _raised(rf: RankFile, cap: int = 5) -> tuple[dict[int, str], int]:
    s = rf.tables.steps
    r = s[s["status"] == StepStatus.RAISED]
    return {int(x["step"]): rf.tables.string(int(x["reason"])) for x in r[:cap]}, int(r.size)


# The field a step's status is compared as (as ``replay info`` names it).
STATUS_FIELD = "step status (raised)"


def _first_status_difference(a: RankFile, b: RankFile, common: np.ndarray) -> FirstDifference | None:
    """The first common step that raised in one run and completed in the other."""
    ta, tb = a.tables.steps, b.tables.steps
    if not common.size or not ((ta["status"] == StepStatus.RAISED).any() or (tb["status"] == StepStatus.RAISED).any()):
        return None
    _, ia, ib = np.intersect1d(ta["step"].astype(np.int64), tb["step"].astype(np.int64), return_indices=True)
    differs = np.flatnonzero((ta["status"][ia] == StepStatus.RAISED) != (tb["status"][ib] == StepStatus.RAISED))
    if not differs.size:
        return None
    i = int(differs[0])
    step = int(ta["step"][ia[i]])
    side, rf, row = ("A", a, ta[ia[i]]) if ta["status"][ia[i]] == StepStatus.RAISED else ("B", b, tb[ib[i]])
    return FirstDifference(step=step, field=STATUS_FIELD, digest_a=None, digest_b=None,
                           note=f"raised in {side} only: {rf.tables.string(int(row['reason']))[:200]}")


def step_facts(a: RankFile, b: RankFile) -> StreamFacts:
    sa = a.tables.steps["step"].astype(np.int64, copy=False)
    sb = b.tables.steps["step"].astype(np.int64, copy=False)
    ra, na = _raised(a)
    rb, nb = _raised(b)
    if np.array_equal(sa, sb):  # the usual case, and the cheap one
        common, only_a, only_b = sa, sa[:0], sb[:0]
    else:
        common, only_a, only_b = np.intersect1d(sa, sb), np.setdiff1d(sa, sb), np.setdiff1d(sb, sa)
    return StreamFacts(steps_a=int(sa.size), steps_b=int(sb.size), common=common, only_a=only_a, only_b=only_b,
                       raised_a=ra, raised_b=rb, n_raised_a=na, n_raised_b=nb)


def margin_at(rf: RankFile, step: int) -> float | None:
    s = rf.tables.steps
    i = np.searchsorted(s["step"], step)
    if i >= s.size or int(s["step"][i]) != step:
        return None
    m = float(s["margin"][i])
    return None if math.isnan(m) else m


# -- one stream, compared -------------------------------------------------------------------------------


def _tensor_comparison(ra: RankFile, rb: RankFile, step: int, name: str, opts: DiffOptions) -> tuple[dict[str, Any] | None, str, Comparison | None]:
    """(comparison json, note, Comparison) for one field at one step, when both tensors are kept."""
    # The rows first: a digest-only field is known as such without importing torch (seconds).
    ta, tb = field_row(ra, step, name), field_row(rb, step, name)
    if isinstance(ta, Missing) or isinstance(tb, Missing):
        why = ta if isinstance(ta, Missing) else tb
        where = "both" if isinstance(ta, Missing) and isinstance(tb, Missing) else ("A" if isinstance(ta, Missing) else "B")
        return None, f"{why} in {where}: the bits differ, by how much is not known", None
    from replay.analysis.compare import compare_tensors

    ta, tb = ra.read_tensor(ta), rb.read_tensor(tb)
    rtol, atol = opts.tolerances()
    c = compare_tensors(ta, tb, name_a="A", name_b="B", rtol=rtol, atol=atol, k=opts.topk)
    return c.to_json(), "", c


def within_tolerance(c: Comparison, opts: DiffOptions) -> bool:
    from replay.analysis.compare import Verdict

    if c.verdict is Verdict.BITWISE_EQUAL:
        return True
    if opts.ulp is not None:
        ok_ulp = c.ulp is not None and c.ulp <= opts.ulp
        if opts.rtol is None and opts.atol is None:
            return ok_ulp
        return ok_ulp and c.verdict is Verdict.WITHIN_TOLERANCE
    return c.verdict is Verdict.WITHIN_TOLERANCE


def _ran(rf: RankFile, step: int) -> str:
    """How a step ran: ``eager (why)`` or ``graph bucket=4 (padded to 4)``."""
    s = rf.step(step)
    if s.mode == "graph":
        pad = int(s.row["padded_size"])
        return f"graph {s.graph_key}" + (f" (padded to {pad})" if pad >= 0 else "")
    return s.mode + (f" ({s.reason})" if s.reason else "")


def _first(rd: RowDiff, i: int, names: Names, ra: RankFile, rb: RankFile, opts: DiffOptions) -> FirstDifference:
    step, name = int(rd.step[i]), names.names[int(rd.gid[i])]
    fd = FirstDifference(step=step, field=name,
                         digest_a=_hex(rd.digest_a[i]) if rd.has_a[i] else None,
                         digest_b=_hex(rd.digest_b[i]) if rd.has_b[i] else None,
                         margin_a=margin_at(ra, step), margin_b=margin_at(rb, step))
    if not (rd.has_a[i] and rd.has_b[i]):
        fd.note = f"recorded in {'A' if rd.has_a[i] else 'B'} only at this step"
    else:
        if name == "graph":
            fd.note = f"A ran {_ran(ra, step)}, B ran {_ran(rb, step)}"
        else:
            fd.comparison, fd.note, _ = _tensor_comparison(ra, rb, step, name, opts)
    return fd


def compare_stream(ra: RankFile, rb: RankFile, names: Names, keep: Callable[[str], bool], opts: DiffOptions, same_layout: bool) -> StreamDiff:
    """Rank ``ra`` of A against rank ``rb`` of B: every (step, field) row, and what the steps say."""
    facts = step_facts(ra, rb)
    rd = diff_rows(field_rows(ra, names, keep), field_rows(rb, names, keep), facts.common)
    first = first_token = None
    if rd.size:
        is_token = np.array([n.startswith("tokens.") for n in names.names] + [False], dtype=bool)
        first = _first(rd, 0, names, ra, rb, opts)
        tok_idx = np.flatnonzero(is_token[rd.gid])
        first_token = _first(rd, int(tok_idx[0]), names, ra, rb, opts) if tok_idx.size else None
    status = _first_status_difference(ra, rb, facts.common)
    if status is not None and (first is None or status.step <= first.step):
        # A step that raised in one run and completed in the other records no outputs where it
        # raised: its missing fields (the graph it ran, its logits) are not what differs first.
        first = status
    s = StreamDiff(rank_a=ra.rank, rank_b=rb.rank, verdict=DiffVerdict.SAME, facts=facts, compared_rows=rd.compared,
                   differing_rows=rd.size, differing_steps=int(np.unique(rd.step).size), first=first, first_token=first_token,
                   same_layout=same_layout, token_fields=any(n.startswith("tokens.") for n in names.names))
    beyond = rd.size
    if rd.size:
        ids, n = np.unique(rd.gid, return_counts=True)  # one row per (step, field): a count of steps
        top = np.argsort(-n, kind="stable")[:8]
        s.by_field = {names.names[int(ids[i])]: int(n[i]) for i in top}
        if opts.tolerant:
            beyond = _apply_tolerance(s, rd, names, ra, rb, opts)
    s.reasons += _step_reasons(facts)
    s.verdict = _stream_verdict(facts, rd, beyond)
    if s.verdict is DiffVerdict.INCOMPLETE and rd.compared == 0 and facts.common.size:
        s.reasons.append("no field recorded in both")
    return s


def _step_reasons(facts: StreamFacts) -> list[str]:
    """Steps one run recorded and the other did not, steps that raised, no common step."""
    reasons = []
    if facts.only_a.size or facts.only_b.size:
        reasons.append(", ".join(f"{a.size} step{'s' if a.size != 1 else ''} recorded in {w} only (first: {int(a[0])})"
                                 for w, a in (("A", facts.only_a), ("B", facts.only_b)) if a.size))
    for w, n, r in (("A", facts.n_raised_a, facts.raised_a), ("B", facts.n_raised_b, facts.raised_b)):
        if n:
            k = next(iter(r))
            reasons.append(f"{n} step{'s' if n != 1 else ''} raised in {w} (first: step {k}: {r[k][:120]})")
    if facts.common.size == 0:
        reasons.append("no step recorded in both")
    return reasons


def _stream_verdict(facts: StreamFacts, rd: RowDiff, beyond: int) -> DiffVerdict:
    """Different when a field differs beyond tolerance or the steps differ (recorded, raised);
    not shown the same when a step raised in both or nothing was compared."""
    raised_differ = set(facts.raised_a) != set(facts.raised_b) or facts.n_raised_a != facts.n_raised_b
    if rd.size and beyond:
        return DiffVerdict.DIFFERENT
    if facts.only_a.size or facts.only_b.size or raised_differ:
        return DiffVerdict.DIFFERENT
    if facts.n_raised_a or facts.common.size == 0 or rd.compared == 0:
        return DiffVerdict.INCOMPLETE
    if rd.size:
        return DiffVerdict.WITHIN_TOLERANCE
    return DiffVerdict.SAME


def _apply_tolerance(s: StreamDiff, rd: RowDiff, names: Names, ra: RankFile, rb: RankFile, opts: DiffOptions) -> int:
    """Compare the differing fields' tensors; return how many are not shown within tolerance."""
    counts = {"within": 0, "beyond": 0, "digest_only": 0, "not_compared": 0, "one_side_only": 0}
    for i in range(rd.size):
        if not (rd.has_a[i] and rd.has_b[i]):
            counts["one_side_only"] += 1
            continue
        if counts["within"] + counts["beyond"] + counts["digest_only"] >= opts.max_tensor_compares:
            counts["not_compared"] = rd.size - i - counts["one_side_only"]
            break
        step, name = int(rd.step[i]), names.names[int(rd.gid[i])]
        js, note, c = _tensor_comparison(ra, rb, step, name, opts)
        if c is None:
            counts["digest_only"] += 1
        elif within_tolerance(c, opts):
            counts["within"] += 1
            continue
        else:
            counts["beyond"] += 1
        if s.first_beyond_tolerance is None:
            fd = _first(rd, i, names, ra, rb, opts)
            s.first_beyond_tolerance = fd
    s.tolerance = counts
    if counts["digest_only"]:
        s.reasons.append(f"{counts['digest_only']} differing field(s) recorded as digests only: tolerance cannot be applied")
    if counts["not_compared"]:
        s.reasons.append(f"{counts['not_compared']} differing field(s) not compared (--max-tensor-compares {opts.max_tensor_compares})")
    return rd.size - counts["within"]


def _hex(d: Any) -> str:
    return f"{int(d):016x}"
