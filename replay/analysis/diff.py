"""``replay diff A B``: two runs compared, what differs first, then what else differs.

A and B are recordings, parts or ranks (``recA``, ``recA:run-000``, ``recA:run-000/3``). The
comparison is organised in streams, one per pair of ranks (rank r of A with rank r of B when the
runs have as many ranks; every rank of the wider run with a rank of the narrower one otherwise).
Per stream: the first (step, field) whose bits differ, the first token divergence and the margin
there, how many steps differ. Fields laid out differently in the two runs (TP=N against TP=M) are
taken out of the streams and compared whole, once their shards are put back together
(``replay.analysis.unshard``). Runs that batched differently are aligned by request and position
where they can be (``replay.analysis.align``). Then what else differs, most likely cause first
(``replay.analysis.diff_context``).

Verdicts are never claimed beyond what was compared: a step that raised, a step one side did not
record, a field that could not be read back whole, each keeps the verdict from "the same".
"""

from __future__ import annotations

import enum
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.align import BatchAlignment, align_batches
from replay.analysis.diff_context import Category, ContextDiff, RankMeta, context_differences, first_numerics_difference, rank_meta
from replay.analysis.diff_sides import Side, open_side
from replay.analysis.diff_streams import Names, RowDiff, StreamFacts, diff_rows, field_rows, margin_at, step_facts, used_ids
from replay.analysis.unshard import Layout, LayoutKind, Missing, field_layout, field_row, field_shape, whole_tensor
from replay.errors import UsageError
from replay.format.reader import RankFile

__all__ = ["DiffOptions", "DiffVerdict", "FirstDifference", "StreamDiff", "UnshardedField", "RunDiff", "diff_runs", "diff"]


@dataclass(kw_only=True, slots=True)
class DiffOptions:
    rtol: float | None = None
    """Relative tolerance: fields whose bits differ but whose values are within it count as the same."""

    atol: float | None = None
    """Absolute tolerance (with ``rtol``; either alone sets the other to 0)."""

    ulp: int | None = None
    """Largest distance in units in the last place allowed between matching elements."""

    topk: int = 5
    """k of the top-k agreement reported for logits."""

    shards: dict[str, int] = field(default_factory=dict)
    """Declared shard dimensions (``{"output.hidden": 1}``) for plain-tensor TP whose recording has
    no layout: the field is split over the part's ranks, in rank order, along that dimension."""

    max_tensor_compares: int = 1000
    """Most tensors read per stream (tolerance) or steps per unsharded field; the rest are said to
    be not compared."""

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise UsageError(f"--{name} must be a finite number >= 0, not {v}")
        if self.ulp is not None and self.ulp < 0:
            raise UsageError(f"--ulp must be >= 0, not {self.ulp}")
        if self.topk < 1:
            raise UsageError(f"--topk must be >= 1, not {self.topk}")
        if self.max_tensor_compares < 1:
            raise UsageError("--max-tensor-compares must be >= 1")

    @property
    def tolerant(self) -> bool:
        return self.rtol is not None or self.atol is not None or self.ulp is not None

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n):g}" for n in ("rtol", "atol") if getattr(self, n) is not None]
        if self.ulp is not None:
            parts.append(f"ulp={self.ulp}")
        return ", ".join(parts) if parts else "bitwise"


class DiffVerdict(enum.Enum):
    SAME = "the same"
    WITHIN_TOLERANCE = "the same within tolerance"
    INCOMPLETE = "not shown to be the same"
    DIFFERENT = "different"

    def __str__(self) -> str:
        return self.value

    @property
    def exit_code(self) -> int:
        """As diff(1): 0 the same, 1 different (or not shown to be the same)."""
        return 0 if self in (DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE) else 1


_SEVERITY = [DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE, DiffVerdict.INCOMPLETE, DiffVerdict.DIFFERENT]


def _worst(vs: list[DiffVerdict]) -> DiffVerdict:
    return max(vs, key=_SEVERITY.index) if vs else DiffVerdict.INCOMPLETE


def _hex(d: Any) -> str:
    return f"{int(d):016x}"


@dataclass(slots=True)
class FirstDifference:
    step: int
    field: str
    digest_a: str | None  # None: not recorded on that side
    digest_b: str | None
    margin_a: float | None = None
    margin_b: float | None = None
    comparison: dict[str, Any] | None = None  # compare_tensors' verdict, when both tensors were kept
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "field": self.field, "digest_a": self.digest_a, "digest_b": self.digest_b,
                "margin_a": self.margin_a, "margin_b": self.margin_b, "comparison": self.comparison, "note": self.note}


@dataclass(slots=True)
class StreamDiff:
    """Rank ``rank_a`` of A against rank ``rank_b`` of B."""

    rank_a: int
    rank_b: int
    verdict: DiffVerdict
    facts: StreamFacts
    compared_rows: int
    differing_rows: int
    differing_steps: int
    first: FirstDifference | None
    first_token: FirstDifference | None
    first_beyond_tolerance: FirstDifference | None = None
    tolerance: dict[str, int] | None = None
    reasons: list[str] = field(default_factory=list)
    same_layout: bool = True  # both runs have as many ranks: rank r is named once
    by_field: dict[str, int] = field(default_factory=dict)  # field -> steps at which it differs (the most first)

    @property
    def name(self) -> str:
        if self.rank_a == self.rank_b and self.same_layout:
            return f"rank {self.rank_a}"
        return f"A rank {self.rank_a} / B rank {self.rank_b}"

    def to_json(self) -> dict[str, Any]:
        return {"stream": self.name, "rank_a": self.rank_a, "rank_b": self.rank_b, "verdict": str(self.verdict),
                **self.facts.to_json(), "compared_fields": self.compared_rows, "differing_fields": self.differing_rows,
                "differing_steps": self.differing_steps, "differing_by_field": self.by_field,
                "first_difference": self.first.to_json() if self.first else None,
                "first_token_divergence": self.first_token.to_json() if self.first_token else None,
                "first_beyond_tolerance": self.first_beyond_tolerance.to_json() if self.first_beyond_tolerance else None,
                "tolerance": self.tolerance, "reasons": self.reasons}


@dataclass(slots=True)
class UnshardedField:
    """A field laid out differently in A and B, compared whole."""

    field: str
    layout_a: str
    layout_b: str
    verdict: DiffVerdict
    compared_steps: int = 0
    differing_steps: int = 0
    first_step: int | None = None
    comparison: dict[str, Any] | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "layout_a": self.layout_a, "layout_b": self.layout_b, "verdict": str(self.verdict),
                "compared_steps": self.compared_steps, "differing_steps": self.differing_steps,
                "first_step": self.first_step, "comparison": self.comparison, "note": self.note}


@dataclass(slots=True)
class RunDiff:
    a: str
    b: str
    verdict: DiffVerdict
    headline: str
    tolerance: str
    layouts: dict[str, int]  # world sizes
    streams: list[StreamDiff]
    unsharded: list[UnshardedField]
    batching: BatchAlignment | None
    context: list[ContextDiff]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @property
    def first(self) -> tuple[StreamDiff, FirstDifference] | None:
        """The earliest first difference over all streams (lowest step, then lowest rank)."""
        cands = [(s.first.step, s.rank_a, s) for s in self.streams if s.first is not None]
        if not cands:
            return None
        s = min(cands, key=lambda c: (c[0], c[1]))[2]
        return s, s.first  # type: ignore[return-value]

    @property
    def first_token(self) -> tuple[StreamDiff, FirstDifference] | None:
        cands = [(s.first_token.step, s.rank_a, s) for s in self.streams if s.first_token is not None]
        if not cands:
            return None
        s = min(cands, key=lambda c: (c[0], c[1]))[2]
        return s, s.first_token  # type: ignore[return-value]

    def to_json(self) -> dict[str, Any]:
        first, tok = self.first, self.first_token
        return {
            "verdict": str(self.verdict), "same": self.exit_code == 0, "headline": self.headline,
            "a": self.a, "b": self.b, "tolerance": self.tolerance, "world_size": self.layouts,
            "first_difference": ({"stream": first[0].name, **first[1].to_json()} if first else None),
            "first_token_divergence": ({"stream": tok[0].name, **tok[1].to_json()} if tok else None),
            "streams": [s.to_json() for s in self.streams],
            "unsharded": [u.to_json() for u in self.unsharded],
            "batching": self.batching.to_json() if self.batching else None,
            "other_differences": [c.to_json() for c in self.context],
            "notes": self.notes,
        }


# -- one stream -------------------------------------------------------------------------------


def _tensor_comparison(ra: RankFile, rb: RankFile, step: int, name: str, opts: DiffOptions) -> tuple[dict[str, Any] | None, str, Any]:
    """(comparison json, note, Comparison) for one field at one step, when both tensors are kept."""
    # The rows first: a digest-only field is known as such without importing torch (seconds).
    ta, tb = field_row(ra, step, name), field_row(rb, step, name)
    if isinstance(ta, Missing) or isinstance(tb, Missing):
        why = ta if isinstance(ta, Missing) else tb
        where = "both" if isinstance(ta, Missing) and isinstance(tb, Missing) else ("A" if isinstance(ta, Missing) else "B")
        return None, f"{why} in {where}: the bits differ, by how much is not known", None
    from replay.analysis.compare import compare_tensors

    ta, tb = ra.read_tensor(ta), rb.read_tensor(tb)
    c = compare_tensors(ta, tb, name_a="A", name_b="B", rtol=opts.rtol, atol=opts.atol, k=opts.topk)
    return c.to_json(), "", c


def _within(c: Any, opts: DiffOptions) -> bool:
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


def _stream(ra: RankFile, rb: RankFile, names: Names, keep: Any, opts: DiffOptions, same_layout: bool) -> StreamDiff:
    facts = step_facts(ra, rb)
    rd = diff_rows(field_rows(ra, names, keep), field_rows(rb, names, keep), facts.common)
    is_token = np.array([n.startswith("tokens.") for n in names.names] + [False], dtype=bool)
    first = _first(rd, 0, names, ra, rb, opts) if rd.size else None
    tok_idx = np.flatnonzero(is_token[rd.gid]) if rd.size else np.zeros(0, dtype=np.int64)
    first_token = _first(rd, int(tok_idx[0]), names, ra, rb, opts) if tok_idx.size else None
    s = StreamDiff(rank_a=ra.rank, rank_b=rb.rank, verdict=DiffVerdict.SAME, facts=facts, compared_rows=rd.compared,
                   differing_rows=rd.size, differing_steps=int(np.unique(rd.step).size), first=first, first_token=first_token,
                   same_layout=same_layout)
    if rd.size:
        ids, n = np.unique(rd.gid, return_counts=True)  # one row per (step, field): a count of steps
        top = np.argsort(-n, kind="stable")[:8]
        s.by_field = {names.names[int(ids[i])]: int(n[i]) for i in top}
    beyond = rd.size
    if opts.tolerant and rd.size:
        beyond = _apply_tolerance(s, rd, names, ra, rb, opts)
    reasons = s.reasons
    if facts.only_a.size or facts.only_b.size:
        reasons.append(", ".join(f"{n} step{'s' if a.size != 1 else ''} recorded in {w} only (first: {int(a[0])})"
                                 for w, a, n in (("A", facts.only_a, facts.only_a.size), ("B", facts.only_b, facts.only_b.size)) if a.size))
    raised_differ = set(facts.raised_a) != set(facts.raised_b) or facts.n_raised_a != facts.n_raised_b
    for w, n, r in (("A", facts.n_raised_a, facts.raised_a), ("B", facts.n_raised_b, facts.raised_b)):
        if n:
            k = next(iter(r))
            reasons.append(f"{n} step{'s' if n != 1 else ''} raised in {w} (first: step {k}: {r[k][:120]})")
    if facts.common.size == 0:
        reasons.append("no step recorded in both")
    if rd.size and beyond:
        s.verdict = DiffVerdict.DIFFERENT
    elif facts.only_a.size or facts.only_b.size or raised_differ:
        s.verdict = DiffVerdict.DIFFERENT
    elif facts.n_raised_a or facts.common.size == 0 or rd.compared == 0:
        s.verdict = DiffVerdict.INCOMPLETE
        if rd.compared == 0 and facts.common.size:
            reasons.append("no field recorded in both")
    elif rd.size:
        s.verdict = DiffVerdict.WITHIN_TOLERANCE
    return s


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
        elif _within(c, opts):
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


# -- fields laid out differently ----------------------------------------------------------------


def _field_names(rf: RankFile) -> list[str]:
    t = rf.tables
    return [t.string(int(i)) for i in used_ids(t.fields["field"])]


def _unsharded(name: str, a: Side, b: Side, la: Layout, lb: Layout, opts: DiffOptions, worlds: tuple[int, int]) -> UnshardedField:
    fa, fb = [a.part[r] for r in a.part], [b.part[r] for r in b.part]
    common = np.intersect1d(fa[0].tables.steps["step"], fb[0].tables.steps["step"])
    u = UnshardedField(field=name, layout_a=la.describe(), layout_b=lb.describe(), verdict=DiffVerdict.SAME)
    for w, files, lay, world in (("A", fa, la, worlds[0]), ("B", fb, lb, worlds[1])):
        if lay.kind is LayoutKind.SHARDED and [rf.rank for rf in files] != list(range(world)):
            u.verdict = DiffVerdict.INCOMPLETE
            u.note = (f"{w}: sharded over {world} ranks but rank files {', '.join(str(rf.rank) for rf in files)} are "
                      "all there is: it cannot be unsharded; not compared")
            return u
    from replay.analysis.compare import Verdict, compare_tensors

    for step in common[: opts.max_tensor_compares]:
        step = int(step)
        ta, tb = whole_tensor(fa, step, name, la), whole_tensor(fb, step, name, lb)
        if isinstance(ta, Missing) or isinstance(tb, Missing):
            u.verdict = DiffVerdict.INCOMPLETE
            u.note = f"{'A' if isinstance(ta, Missing) else 'B'}: {ta if isinstance(ta, Missing) else tb}; not compared"
            return u
        u.compared_steps += 1
        c = compare_tensors(ta, tb, name_a="A", name_b="B", rtol=opts.rtol, atol=opts.atol, k=opts.topk)
        if c.verdict is Verdict.BITWISE_EQUAL or (opts.tolerant and _within(c, opts)):
            if c.verdict is not Verdict.BITWISE_EQUAL and u.verdict is DiffVerdict.SAME:
                u.verdict = DiffVerdict.WITHIN_TOLERANCE
            continue
        u.differing_steps += 1
        if u.first_step is None:
            u.first_step, u.comparison = step, c.to_json()
        u.verdict = DiffVerdict.DIFFERENT
    if common.size == 0:
        u.verdict, u.note = DiffVerdict.INCOMPLETE, "no step recorded in both"
    elif common.size > opts.max_tensor_compares and u.verdict is not DiffVerdict.DIFFERENT:
        u.verdict = DiffVerdict.INCOMPLETE
        u.note = f"compared the first {opts.max_tensor_compares} of {common.size} steps (--max-tensor-compares)"
    return u


# -- the whole diff -----------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class _PairJob:
    """One stream to compare, by paths: a worker process opens the two rank files itself."""

    dir_a: Path
    rank_a: int
    dir_b: Path
    rank_b: int
    excluded: frozenset[str]
    opts: DiffOptions
    same_layout: bool


def _run_pair(job: _PairJob) -> tuple[StreamDiff, RankMeta, RankMeta, dict[str, Any] | None]:
    ra, rb = RankFile(job.dir_a, job.rank_a), RankFile(job.dir_b, job.rank_b)
    s = _stream(ra, rb, Names(), lambda n: n not in job.excluded, job.opts, job.same_layout)
    return s, rank_meta(ra), rank_meta(rb), first_numerics_difference(ra, rb)


# Rank files larger than this in all (bytes of .h5/.journal) are compared in parallel processes:
# reading the tables is most of the time, and one process reads one file at a time.
_PARALLEL_BYTES = 32 << 20


def _compare_pairs(jobs: list[_PairJob]) -> list[tuple[StreamDiff, RankMeta, RankMeta, dict[str, Any] | None]]:
    def size(d: Path, r: int) -> int:
        for suffix in (".h5", ".journal"):
            p = d / f"rank-{r:05d}{suffix}"
            if p.exists():
                return p.stat().st_size
        return 0

    total = sum(size(j.dir_a, j.rank_a) + size(j.dir_b, j.rank_b) for j in jobs)
    workers = min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    if total < _PARALLEL_BYTES or workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_run_pair(j) for j in jobs]
    # fork: the workers start in milliseconds and need nothing from the parent but the job (the
    # parent has read no rank file yet, so no HDF5 state is shared).
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_run_pair, jobs))


def _world(side: Side) -> int:
    """The part's declared world size (one rank's attribute), else the number of its rank files."""
    ws = side.part[next(iter(side.part))].attrs.get("world_size")
    return ws if isinstance(ws, int) and not isinstance(ws, bool) and 0 < ws <= 1 << 16 else len(side.part)


def _pairs(a: Side, b: Side, same_world: bool) -> tuple[list[tuple[int, int]], list[str]]:
    """The rank pairs compared, and a note per rank that only one run has a file for."""
    if same_world and not a.rank_given and not b.rank_given:
        both = sorted(set(a.ranks) & set(b.ranks))
        notes = [f"rank {r}: no rank file in {w}, not compared" for w, mine, other in (("B", a.ranks, b.ranks), ("A", b.ranks, a.ranks))
                 for r in sorted(set(mine) - set(other))]
        if both:
            return [(r, r) for r in both], notes
    return _spread(a, b), []


def _spread(a: Side, b: Side) -> list[tuple[int, int]]:
    if len(a.ranks) == len(b.ranks):
        return list(zip(a.ranks, b.ranks))
    if len(a.ranks) > len(b.ranks):
        return [(r, b.ranks[i % len(b.ranks)]) for i, r in enumerate(a.ranks)]
    return [(a.ranks[i % len(a.ranks)], r) for i, r in enumerate(b.ranks)]


def diff_runs(a: Side, b: Side, options: DiffOptions | None = None) -> RunDiff:
    """Compare two opened sides (see ``replay.analysis.diff_sides.open_side``)."""
    opts = options or DiffOptions()
    wa, wb = _world(a), _world(b)
    pairs, missing = _pairs(a, b, wa == wb)
    files = [(a.part[x], b.part[y]) for x, y in pairs]
    notes: list[str] = list(missing)
    unsharded: list[UnshardedField] = []
    excluded: set[str] = set()
    a0, b0 = a.part[next(iter(a.part))], b.part[next(iter(b.part))]
    if wa != wb:
        # Laid out differently: a sharded field's per-rank digests differ by design, so such a
        # field is compared whole instead of rank by rank; and collectives belong to a layout (a
        # TP=1 run has no all-reduce), so they are not compared at all.
        names_ab = sorted(set(_field_names(a0)) | set(_field_names(b0)))
        coll = [n for n in names_ab if n.startswith("collective.")]
        excluded.update(coll)
        if coll:
            notes.append(f"{len(coll)} collective field(s) not compared: collectives differ with the layout")
        for name in (n for n in names_ab if not n.startswith("collective.")):
            la, lb = field_layout(a0.attrs, name, opts.shards), field_layout(b0.attrs, name, opts.shards)
            if la.kind is LayoutKind.REPLICATED and lb.kind is LayoutKind.REPLICATED:
                continue
            excluded.add(name)
            unsharded.append(_unsharded(name, a, b, la, lb, opts, (wa, wb)))
        notes.append(f"A has {wa} rank(s) and B {wb}: replicated fields are compared rank against rank, "
                     "sharded fields whole" + ("" if unsharded else " (no field has a recorded or declared shard layout)"))
        notes += _shape_notes(files[0], excluded)
    elif opts.shards:
        notes.append("--shard ignored: A and B have the same layout, so shards are compared shard against shard")
    jobs = [_PairJob(dir_a=a.part.path, rank_a=x, dir_b=b.part.path, rank_b=y, excluded=frozenset(excluded),
                     opts=opts, same_layout=wa == wb) for x, y in pairs]
    done = _compare_pairs(jobs)
    streams = [s for s, _, _, _ in done]
    batching = _batching(streams[0], files[0])
    context = context_differences([(ma, mb) for _, ma, mb, _ in done], a.recording.manifest, b.recording.manifest,
                                  same_layout=wa == wb, numerics_per_step=next((n for *_, n in done if n), None))
    weights = next(c for c in context if c.category is Category.WEIGHTS)
    verdict = _worst([s.verdict for s in streams] + [u.verdict for u in unsharded]
                     + ([DiffVerdict.DIFFERENT] if weights.differs else [])
                     + ([DiffVerdict.INCOMPLETE] if missing else []))
    rd = RunDiff(a=a.describe(), b=b.describe(), verdict=verdict, headline="", tolerance=opts.describe(),
                 layouts={"a": wa, "b": wb}, streams=streams, unsharded=unsharded,
                 batching=batching if batching.batched_differently else None, context=context, notes=notes)
    rd.headline = _headline(rd)
    return rd


def _batching(s: StreamDiff, pair: tuple[RankFile, RankFile]) -> BatchAlignment:
    """Another batching changes the inputs' shapes, so their digests at the first common step:
    only then are the /tensors tables read to look."""
    f = s.first
    if f is None or not s.facts.common.size or f.step != int(s.facts.common[0]) or not f.field.startswith("input."):
        return BatchAlignment(batched_differently=False)
    ra, rb = pair
    return align_batches(ra, rb, ra.tables.steps["step"], rb.tables.steps["step"])


def _shape_notes(pair: tuple[RankFile, RankFile], excluded: set[str]) -> list[str]:
    """Fields whose shapes differ across layouts with no layout to rebuild them by."""
    ra, rb = pair
    common = np.intersect1d(ra.tables.steps["step"], rb.tables.steps["step"])
    if not common.size:
        return []
    s = int(common[0])
    out = []
    for name in sorted((set(_field_names(ra)) & set(_field_names(rb))) - excluded):
        sa, sb = field_shape(ra, s, name), field_shape(rb, s, name)
        if sa is not None and sb is not None and sa != sb:
            out.append(f"{name} has shape {sa} in A and {sb} in B and no layout is recorded: it cannot be unsharded "
                       f"(declare it: --shard {name}=DIM)")
    return out


def _fmt_margin(m: float | None) -> str:
    return "unknown" if m is None else f"{m:.3g}"


def _headline(rd: RunDiff) -> str:
    """The first line of the output: the verdict, then the one fact that says most."""
    v = rd.verdict
    n_steps = max((s.facts.common.size for s in rd.streams), default=0)
    if v is DiffVerdict.SAME:
        return (f"the same: every field of every step has the same bits ({len(rd.streams)} stream"
                f"{'s' if len(rd.streams) != 1 else ''} x {n_steps} steps"
                + (f", {len(rd.unsharded)} field(s) compared unsharded" if rd.unsharded else "") + ")")
    if v is DiffVerdict.WITHIN_TOLERANCE:
        n = sum(s.differing_rows for s in rd.streams)
        return f"the same within tolerance ({rd.tolerance}): {n} field(s) differ in bits, every one within tolerance"
    first, tok = rd.first, rd.first_token
    if v is DiffVerdict.DIFFERENT:
        if first is not None:
            s, f = first
            steps = sum(x.differing_steps for x in rd.streams if x is s)
            text = f"different: {s.name} step {f.step}: {f.field} first differs; {steps} of {s.facts.common.size} steps differ"
            if tok is not None:
                ts, t = tok
                text += f"; first token divergence step {t.step} ({t.field}, margin A {_fmt_margin(t.margin_a)}, B {_fmt_margin(t.margin_b)})"
            else:
                text += "; no token divergence"
            if rd.batching is not None:
                text += "; the runs batched differently" + (" (rows aligned below)" if rd.batching.aligned else "")
            return text
        bad = [u for u in rd.unsharded if u.verdict is DiffVerdict.DIFFERENT]
        if bad:
            return f"different: {bad[0].field} (compared unsharded) first differs at step {bad[0].first_step}"
        weights = next((c for c in rd.context if c.category is Category.WEIGHTS and c.differs), None)
        if weights is not None:
            names = ", ".join(str(i["name"]) for i in weights.items[:3])
            return f"different: weights differ ({names}{', ...' if weights.count > 3 else ''}); every step's fields have the same bits"
        s = next(x for x in rd.streams if x.verdict is DiffVerdict.DIFFERENT)
        return f"different: {s.name}: {'; '.join(s.reasons) or 'fields differ'}"
    reasons = ([f"{s.name}: {r}" for s in rd.streams for r in s.reasons] + [f"{u.field}: {u.note}" for u in rd.unsharded if u.note]
               + [n for n in rd.notes if n.endswith("not compared")])
    return f"not shown to be the same: {reasons[0] if reasons else 'nothing was compared'}"


def diff(a: str, b: str, options: DiffOptions | None = None) -> RunDiff:
    """``replay diff A B`` as a library call: open both sides and compare them."""
    sa = open_side(a, "A")
    sb = open_side(b, "B")
    try:
        return diff_runs(sa, sb, options)
    finally:
        sa.recording.close()
        sb.recording.close()
