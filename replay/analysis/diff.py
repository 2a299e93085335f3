"""``replay diff A B``: two runs compared, what differs first, then what else differs.

A and B are recordings, parts or ranks (``recA``, ``recA:run-000``, ``recA:run-000/3``). The
comparison is organised in streams, one per pair of ranks (rank r of A with rank r of B when the
runs have as many ranks; every rank of the wider run with a rank of the narrower one otherwise).
Per stream (``replay.analysis.diff_streams``): the first (step, field) whose bits differ, the first
token divergence and the margin there, how many steps differ. Fields laid out differently in the
two runs (TP=N against TP=M) are taken out of the streams and compared whole, once their shards
are put back together (``replay.analysis.unshard``). Runs that batched differently are aligned by
request and position where they can be (``replay.analysis.align``). Then what else differs, most
likely cause first (``replay.analysis.diff_context``).

Verdicts are never claimed beyond what was compared: a step that raised, a step one side did not
record, a field that could not be read back whole, each keeps the verdict from "the same".
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.collective_inputs import INPUT_SUFFIX, first_input_difference
from replay.analysis.align import BatchAlignment, align_batches
from replay.analysis.diff_context import (Category, RankMeta, arguments_difference, context_differences,
                                          first_numerics_difference, rank_meta)
from replay.analysis.diff_records import (
    DiffOptions, DiffVerdict, FirstDifference, RecordingDiff, RunDiff, StreamDiff, UnshardedField, worst,
)
from replay.analysis.diff_sides import Side, open_sides
from replay.analysis.diff_streams import Names, compare_stream, used_ids, within_tolerance
from replay.analysis.divergence import computed_fields
from replay.analysis.streams import step_streams, stream_position
from replay.analysis.unshard import Layout, LayoutKind, Missing, field_layout, field_shape, whole_tensor
from replay.errors import RecordingDamaged
from replay.format.reader import RankFile

__all__ = ["DiffOptions", "DiffVerdict", "FirstDifference", "StreamDiff", "UnshardedField", "RunDiff", "RecordingDiff",
           "diff_runs", "diff", "first_difference"]


# Equal inputs, arguments and collectives alone never make two runs "the same".
NOTHING_COMPUTED = "only what went into the steps was recorded (no output or token field)"


# -- fields laid out differently ----------------------------------------------------------------


def _field_names(rf: RankFile) -> list[str]:
    t = rf.tables
    return [t.string(int(i)) for i in used_ids(t.fields["field"])]


def _unsharded(name: str, a: Side, b: Side, la: Layout, lb: Layout, opts: DiffOptions, worlds: tuple[int, int]) -> UnshardedField:
    fa, fb = [a.part[r] for r in a.part], [b.part[r] for r in b.part]
    common = np.intersect1d(fa[0].tables.steps["step"], fb[0].tables.steps["step"])
    u = UnshardedField(field=name, layout_a=la.describe(), layout_b=lb.describe(), verdict=DiffVerdict.SAME)
    incomplete = _incomplete_shards(((("A", fa, la, worlds[0]), ("B", fb, lb, worlds[1]))))
    if incomplete:
        u.verdict, u.note = DiffVerdict.INCOMPLETE, incomplete
        return u
    for step in common[: opts.max_tensor_compares]:
        if not _compare_whole(u, int(step), fa, fb, la, lb, opts):
            return u
    if common.size == 0:
        u.verdict, u.note = DiffVerdict.INCOMPLETE, "no step recorded in both"
    elif common.size > opts.max_tensor_compares and u.verdict is not DiffVerdict.DIFFERENT:
        u.verdict = DiffVerdict.INCOMPLETE
        u.note = f"compared the first {opts.max_tensor_compares} of {common.size} steps (--max-tensor-compares)"
    return u


def _incomplete_shards(sides: tuple[tuple[str, list[RankFile], Layout, int], ...]) -> str:
    """Why a side's shards cannot be put back together (a rank file missing), or ""."""
    for w, files, lay, world in sides:
        if lay.kind is LayoutKind.SHARDED and [rf.rank for rf in files] != list(range(world)):
            return (f"{w}: sharded over {world} ranks but rank files {', '.join(str(rf.rank) for rf in files)} are "
                    "all there is: it cannot be unsharded; not compared")
    return ""


def _compare_whole(u: UnshardedField, step: int, fa: list[RankFile], fb: list[RankFile], la: Layout, lb: Layout,
                   opts: DiffOptions) -> bool:
    """Compare ``u.field`` at ``step``, put back together on both sides, into ``u``; False when a
    side cannot be read back whole (``u`` then says why and is not the same)."""
    from replay.analysis.compare import Verdict, compare_tensors

    ta, tb = whole_tensor(fa, step, u.field, la), whole_tensor(fb, step, u.field, lb)
    if isinstance(ta, Missing) or isinstance(tb, Missing):
        u.verdict = DiffVerdict.INCOMPLETE
        u.note = f"{'A' if isinstance(ta, Missing) else 'B'}: {ta if isinstance(ta, Missing) else tb}; not compared"
        return False
    u.compared_steps += 1
    rtol, atol = opts.tolerances()
    c = compare_tensors(ta, tb, name_a="A", name_b="B", rtol=rtol, atol=atol, k=opts.topk)
    if c.verdict is Verdict.BITWISE_EQUAL or (opts.tolerant and within_tolerance(c, opts)):
        if c.verdict is not Verdict.BITWISE_EQUAL and u.verdict is DiffVerdict.SAME:
            u.verdict = DiffVerdict.WITHIN_TOLERANCE
        return True
    u.differing_steps += 1
    if u.first_step is None:
        u.first_step, u.comparison = step, c.to_json()
    u.verdict = DiffVerdict.DIFFERENT
    return True


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


# What comparing one pair of rank files gives: the stream's diff, each side's settings, the first
# step whose numerics context differs, and the step arguments that differ.
_PairFacts = tuple[StreamDiff, RankMeta, RankMeta, "dict[str, Any] | None", "list[dict[str, Any]] | None"]


def _run_pair(job: _PairJob) -> _PairFacts:
    ra, rb = RankFile(job.dir_a, job.rank_a), RankFile(job.dir_b, job.rank_b)
    s = compare_stream(ra, rb, Names(), lambda n: n not in job.excluded, job.opts, job.same_layout)
    _label_models(s, ra, rb)
    return s, rank_meta(ra), rank_meta(rb), first_numerics_difference(ra, rb), arguments_difference(ra, rb)


def _label_models(s: StreamDiff, ra: RankFile, rb: RankFile) -> None:
    """Name the model (draft, target) of each first difference, and the first step the runs ran
    different models at, when a loop runs several."""
    steps_a, index_a, names_a = step_streams(ra)
    if not names_a:
        return
    for f in (s.first, s.first_token, s.first_beyond_tolerance):
        at = stream_position(steps_a, index_a, names_a, f.step) if f is not None else None
        if at is not None:
            f.model, f.model_step = at  # type: ignore[union-attr]
    steps_b, index_b, names_b = step_streams(rb)
    if not names_b:
        return
    common, xa, xb = np.intersect1d(steps_a, steps_b, return_indices=True)
    model_a = np.array(names_a, dtype=object)[index_a[xa]]
    model_b = np.array(names_b, dtype=object)[index_b[xb]]
    apart = np.flatnonzero(model_a != model_b)
    if apart.size:
        i = int(apart[0])
        s.models_apart = (f"{s.name}: from step {int(common[i])} the runs ran their models in another order (A {model_a[i]}, "
                          f"B {model_b[i]}): steps are paired by number, so from there a step of one model is compared "
                          f"with a step of the other")


# Rank files larger than this in all (bytes of .h5/.journal) are compared in parallel processes:
# reading the tables is most of the time, and one process reads one file at a time.
_PARALLEL_BYTES = 32 << 20


def _idle_cores() -> int:
    """Cores this process may use that nothing else is busy on: on a machine already loaded,
    more processes only add the cost of starting them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, int(cores - busy + 1)))  # +1: this process is one of the busy ones


def _compare_pairs(jobs: list[_PairJob]) -> list[_PairFacts]:
    def size(d: Path, r: int) -> int:
        for suffix in (".h5", ".journal"):
            p = d / f"rank-{r:05d}{suffix}"
            if p.exists():
                return p.stat().st_size
        return 0

    total = sum(size(j.dir_a, j.rank_a) + size(j.dir_b, j.rank_b) for j in jobs)
    workers = min(len(jobs), _idle_cores())
    if total < _PARALLEL_BYTES or workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_run_pair(j) for j in jobs]
    # fork: the workers start in milliseconds and need nothing from the parent but the job (the
    # parent has read no rank file yet, so no HDF5 state is shared).
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_run_pair, jobs))


def _worlds(a: Side, b: Side) -> tuple[int, int]:
    """The parts' world sizes. When both list ranks 0..n-1 for the same n, that is n, known from
    the listing alone; otherwise what a rank file of each declares, so that a missing rank file
    is told apart from a smaller layout."""
    if len(a.part) == len(b.part) and all(list(s.part) == list(range(len(s.part))) for s in (a, b)):
        return len(a.part), len(b.part)
    return _declared_world(a), _declared_world(b)


def _declared_world(side: Side) -> int:
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
    wa, wb = _worlds(a, b)
    pairs, missing = _pairs(a, b, wa == wb)
    files = [(a.part[x], b.part[y]) for x, y in pairs]
    notes: list[str] = list(missing)
    unsharded: list[UnshardedField] = []
    excluded: set[str] = set()
    if wa != wb:
        unsharded, excluded, layout_notes = _across_layouts(a, b, opts, (wa, wb))
        notes += layout_notes + _shape_notes(files[0], excluded)
    elif opts.shards:
        notes.append("--shard ignored: A and B have the same layout, so shards are compared shard against shard")
    jobs = [_PairJob(dir_a=a.part.path, rank_a=x, dir_b=b.part.path, rank_b=y, excluded=frozenset(excluded),
                     opts=opts, same_layout=wa == wb) for x, y in pairs]
    done = _compare_pairs(jobs)
    streams = [s for s, *_ in done]
    notes += _models_apart(streams)
    batching = _batching(streams, files[0])
    context = _context(done, a, b, same_layout=wa == wb)
    weights = next(c for c in context if c.category is Category.WEIGHTS)
    verdict = worst([s.verdict for s in streams] + [u.verdict for u in unsharded]
                    + ([DiffVerdict.DIFFERENT] if weights.differs else [])
                    + ([DiffVerdict.INCOMPLETE] if missing else []))
    unshown = _unless_nothing_computed(verdict, files, notes)
    if unshown is not verdict:
        # No rank recorded a field its steps computed: each stream's row too, as a row saying
        # "the same" under a headline that does not is a contradiction a reader takes half of.
        verdict = unshown
        for s in streams:
            if s.verdict in (DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE):
                s.verdict = DiffVerdict.INCOMPLETE
    hidden = _hidden_input(verdict, files, streams) if wa == wb else None
    if hidden is not None:
        verdict = DiffVerdict.DIFFERENT
    verdict = _unless_offset(verdict, files, notes)
    rd = RunDiff(a=a.describe(), b=b.describe(), verdict=verdict, headline="", tolerance=opts.describe(),
                 layouts={"a": wa, "b": wb}, streams=streams, unsharded=unsharded,
                 batching=batching if batching.batched_differently else None, context=context, notes=notes,
                 hidden_input=hidden)
    rd.collective_inputs = _collective_inputs(rd, files, same_layout=wa == wb)
    rd.headline = _headline(rd)
    rd.next = _next_command(rd, a, b)
    return rd


_OFFSET_NOTE = "steps numbered from other calls"


def _unless_offset(verdict: DiffVerdict, files: list[tuple[RankFile, RankFile]], notes: list[str]) -> DiffVerdict:
    """Step i of A is another call of the program than step i of B: their fields differ because
    other calls are compared, which says nothing of the runs ("not shown to be the same")."""
    offset = _call_offset(files)
    if offset is None or verdict is not DiffVerdict.DIFFERENT:
        return verdict
    notes.insert(0, offset)
    return DiffVerdict.INCOMPLETE


def _call_offset(files: list[tuple[RankFile, RankFile]]) -> str | None:
    """Where A's step 0 is another call of the step than B's: found with no flags, a step is
    recorded from its second call in a process's first engine run and from its first in the
    runs after it (a task pool's worker taking a second task), so the same task's steps are
    numbered from other calls in two runs. None when the numbering is the same."""
    for fa, fb in files:
        ua, ub = _unrecorded_calls(fa), _unrecorded_calls(fb)
        if ua != ub:
            return (f"{_OFFSET_NOTE}: A's step 0 is the step's call {ua + 1}, B's its call {ub + 1} (rank {fa.rank}; the "
                    "first call runs unrecorded while the step is found with no flags), so each step is compared with "
                    "another call; name the step when recording (--step) to number every run's steps from its first call")
    return None


def _unrecorded_calls(rf: RankFile) -> int:
    t = rf.attrs.get("target")
    n = t.get("unrecorded_calls") if isinstance(t, dict) else 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def _context(done: list[_PairFacts], a: Side, b: Side, *, same_layout: bool) -> list[Any]:
    """What else differs, from every pair's settings and numerics steps, and the step arguments."""
    return context_differences([(ma, mb) for _, ma, mb, *_ in done], a.recording.manifest, b.recording.manifest,
                               same_layout=same_layout, numerics_per_step=[n for *_, n, _ in done],
                               arguments=_pair_arguments(done))


def _pair_arguments(done: list[_PairFacts]) -> list[dict[str, Any]] | None:
    """The step arguments that differ, from the first rank pair where any does (across world
    sizes a pair of other ranks can differ in a rank argument where the first pair does not),
    each named with its pair when there are several; None when no pair recorded any."""
    found = [(s, g) for s, *_, g in done if g is not None]
    if not found:
        return None
    s, g = next(((s, g) for s, g in found if g), found[0])
    return [{**it, "rank_a": s.rank_a, "rank_b": s.rank_b} for it in g] if len(done) > 1 else g


def _hidden_input(verdict: DiffVerdict, files: list[tuple[RankFile, RankFile]], streams: list[StreamDiff]) -> dict[str, Any] | None:
    """Runs whose every field agrees (in bits or within tolerance) where a collective's input
    differs between them: a rank that sampled another token before a broadcast from rank 0, or
    whose logits drifted before an all_reduce, hands every rank the same output, so no field
    shows it. Its stream's row says so (not "the same" under a "different" headline)."""
    if verdict not in (DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE):
        return None
    try:
        found = first_input_difference(files)
    except RecordingDamaged:
        return None  # a damaged collectives table: not compared (reading the steps says why)
    if found is None:
        return None
    rank, step, field_name = found
    what = (f"step {step}: the input of {field_name[:-len(INPUT_SUFFIX)]} differs, where it agrees between the runs at most "
            "steps or agreed at every step before; every rank received the same output, which hides the change from the "
            "fields after it")
    for st in streams:
        if st.rank_a == rank:
            st.verdict = DiffVerdict.DIFFERENT
            st.reasons.append(what)
    return {"rank": rank, "step": step, "field": field_name, "what": what}


def _collective_inputs(rd: RunDiff, files: list[tuple[RankFile, RankFile]], *, same_layout: bool) -> list[int] | None:
    """When the first difference is a collective's output (``collective.N.op``): the ranks of A
    whose input to that collective differs from B's. Every rank gets the same output, so the
    first rank differing says nothing of who changed; the inputs do. None when not known (or
    the runs are laid out otherwise: their collectives are not compared)."""
    first = rd.first
    if not same_layout or first is None or not first[1].field.startswith("collective."):
        return None
    step, place = first[1].step, first[1].field.split(".")[1]
    if not place.isdigit():
        return None
    differ = []
    for ra, rb in files:
        da, db = _collective_input(ra, step, int(place)), _collective_input(rb, step, int(place))
        if da is None or db is None:
            return None
        if da != db:
            differ.append(ra.rank)
    return differ if 0 < len(differ) < len(files) else None


def _collective_input(rf: RankFile, step: int, place: int) -> int | None:
    """The input digest of the step's collective at ``place`` (its order within the step)."""
    c = rf.full().collectives
    rows = c[c["step"] == step]
    rows = rows[np.argsort(rows["ordinal"], kind="stable")]
    return int(rows["in_digest"][place]) if place < len(rows) else None


def _models_apart(streams: list[StreamDiff]) -> list[str]:
    return [s.models_apart for s in streams if s.models_apart]


def _unless_nothing_computed(verdict: DiffVerdict, files: list[tuple[RankFile, RankFile]], notes: list[str]) -> DiffVerdict:
    """Equal inputs and collectives do not show that the runs computed the same."""
    if verdict not in (DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE):
        return verdict
    if computed_fields({n for pair in files for rf in pair for n in _field_names(rf)}):
        return verdict
    notes.append(f"{NOTHING_COMPUTED}: what the steps computed was not compared")
    return DiffVerdict.INCOMPLETE


def _next_command(rd: RunDiff, a: Side, b: Side) -> str:
    """``replay bisect layers --between run:A,run:B`` at the first difference, when both rank
    files name a factory a re-run can rebuild the target with (a layer bisection across runs
    needs one: without, the command would only say so); else ""."""
    if rd.first is None or rd.verdict is not DiffVerdict.DIFFERENT:
        return ""
    s, f = rd.first
    files = (a.part[s.rank_a], b.part[s.rank_b])
    targets = [rf.attrs.get("target") for rf in files]
    if not all(isinstance(t, dict) and t.get("factory") for t in targets):
        return ""
    spec_a = f"{a.recording.path}:{a.part.name}/{s.rank_a}"
    spec_b = f"{b.recording.path}:{b.part.name}/{s.rank_b}"
    return f"replay bisect layers --between {shlex.quote(f'run:{spec_a},run:{spec_b}')} --step {f.step}"


def _across_layouts(a: Side, b: Side, opts: DiffOptions, worlds: tuple[int, int]) -> tuple[list[UnshardedField], set[str], list[str]]:
    """Runs laid out differently: a sharded field's per-rank digests differ by design, so such a
    field is compared whole instead of rank by rank; and collectives belong to a layout (a TP=1
    run has no all-reduce), so they are not compared at all. Returns (fields compared whole,
    fields taken out of the streams, notes)."""
    a0, b0 = a.part[next(iter(a.part))], b.part[next(iter(b.part))]
    names_ab = sorted(set(_field_names(a0)) | set(_field_names(b0)))
    coll = [n for n in names_ab if n.startswith("collective.")]
    excluded = set(coll)
    notes = [f"{len(coll)} collective field(s) not compared: collectives differ with the layout"] if coll else []
    unsharded: list[UnshardedField] = []
    for name in (n for n in names_ab if not n.startswith("collective.")):
        la, lb = field_layout(a0.attrs, name, opts.shards), field_layout(b0.attrs, name, opts.shards)
        if la.kind is LayoutKind.REPLICATED and lb.kind is LayoutKind.REPLICATED:
            continue
        excluded.add(name)
        unsharded.append(_unsharded(name, a, b, la, lb, opts, worlds))
    notes.append(f"A has {worlds[0]} rank(s) and B {worlds[1]}: replicated fields are compared rank against rank, "
                 "sharded fields whole" + ("" if unsharded else " (no field has a recorded or declared shard layout)"))
    return unsharded, excluded, notes


def _batching(streams: list[StreamDiff], pair: tuple[RankFile, RankFile]) -> BatchAlignment:
    """Another batching changes the inputs' shapes, so their digests at the first step that
    differs (a batch that shrinks as requests end: a later one): only then are the /tensors
    tables read to look."""
    s = streams[0]
    f = s.first
    if f is None or not s.facts.common.size or not f.field.startswith("input."):
        return BatchAlignment(batched_differently=False)
    ra, rb = pair
    found = align_batches(ra, rb, ra.tables.steps["step"], rb.tables.steps["step"], at=f.step)
    if found.batched_differently:
        # Step N of A is not step N of B: their tokens are whole batches of other requests, and
        # a "token divergence" between them says nothing; rows aligned by request say it instead.
        for x in streams:
            x.first_token = None
    return found


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
    if v is DiffVerdict.SAME:
        return _same_headline(rd)
    if v is DiffVerdict.WITHIN_TOLERANCE:
        n = sum(s.differing_rows for s in rd.streams)
        return f"the same within tolerance ({rd.tolerance}): {n} field(s) differ in bits, every one within tolerance"
    if v is DiffVerdict.DIFFERENT:
        # A first difference in bits that every stream found within tolerance is not why the
        # runs differ (the weights are): the headline says what is.
        fields_differ = any(s.verdict is DiffVerdict.DIFFERENT for s in rd.streams)
        return _different_headline(rd) if rd.first is not None and fields_differ else _different_elsewhere(rd)
    offset = [n for n in rd.notes if n.startswith(_OFFSET_NOTE)]
    reasons = offset + ([f"{s.name}: {r}" for s in rd.streams for r in s.reasons] + [f"{u.field}: {u.note}" for u in rd.unsharded if u.note]
               + [n for n in rd.notes if n.endswith("not compared")])
    return f"not shown to be the same: {reasons[0] if reasons else 'nothing was compared'}"


def _same_headline(rd: RunDiff) -> str:
    n_steps = max((s.facts.common.size for s in rd.streams), default=0)
    plural = "s" if len(rd.streams) != 1 else ""
    # Each compared pair is a rank of A against a rank of B ("stream" is the draft/target word of `info`).
    unit = "rank" if all(x.same_layout and x.rank_a == x.rank_b for x in rd.streams) else "rank pair"
    unsharded = f", {len(rd.unsharded)} field(s) compared unsharded" if rd.unsharded else ""
    return f"the same: every field of every step has the same bits ({len(rd.streams)} {unit}{plural} x {n_steps} steps{unsharded})"


def _differing_weights(rd: RunDiff) -> Any:
    return next((c for c in rd.context if c.category is Category.WEIGHTS and c.differs), None)


def _different_headline(rd: RunDiff) -> str:
    """Different, with a first (step, field): where, how many steps, the tokens, then the likeliest cause."""
    assert rd.first is not None
    s, f = rd.first
    steps = sum(x.differing_steps for x in rd.streams if x is s)
    text = f"different: {s.name} {f.where}: {f.field} first differs; {steps} of {s.facts.common.size} steps differ"
    if rd.batching is not None:
        text += "; the runs batched differently: " + _batching_clause(rd.batching)
    elif rd.first_token is not None:
        t = rd.first_token[1]
        text += f"; first token divergence {t.where} ({t.field}, smallest top-2 margin of its rows A {_fmt_margin(t.margin_a)}, B {_fmt_margin(t.margin_b)})"
    elif any(x.token_fields for x in rd.streams):
        text += "; no token divergence"
    else:
        text += "; no token field recorded to compare"
    if rd.collective_inputs:
        text += (f"; its input differs only on rank{'s' if len(rd.collective_inputs) > 1 else ''} "
                 f"{', '.join(map(str, rd.collective_inputs))} (the collective spread that change to every rank)")
    weights = _differing_weights(rd)
    if weights is not None:  # the likeliest cause, named on the first line
        text += f"; weights differ: {weights.items[0]['name']}" + (f" and {weights.count - 1} more" if weights.count > 1 else "")
    args = next((c for c in rd.context if c.category is Category.ARGUMENTS and c.differs), None)
    if weights is None and args is not None and args.items[0]["step"] <= f.step:
        it = args.items[0]  # a step argument that already differed where the fields began to
        text += f"; the step's argument {it['name']} differs from step {it['step']}: A {it['a']}, B {it['b']}"
    return text


def _batching_clause(bt: BatchAlignment) -> str:
    """What aligning rows by request found, for the headline (the step-by-step tokens compare
    batches of other requests)."""
    if not bt.aligned:
        return "rows cannot be aligned (below), so tokens are not compared"
    fb = bt.first
    where = f", first request {fb['request']} position {fb['position']} ({fb['field']})" if fb else ""
    return f"by request and position, {bt.rows_differ} of {bt.rows_compared} rows differ in {', '.join(bt.fields)}{where}"


def _different_elsewhere(rd: RunDiff) -> str:
    """Different, with no stream row that differs: an unsharded field, the weights, a collective's
    input hidden by its output, or a stream's reasons."""
    if rd.hidden_input is not None:
        h = rd.hidden_input
        return f"different: rank {h['rank']} {h['what']}; every field of every step has the same bits"
    bad = [u for u in rd.unsharded if u.verdict is DiffVerdict.DIFFERENT]
    if bad:
        return f"different: {bad[0].field} (compared unsharded) first differs at step {bad[0].first_step}"
    weights = _differing_weights(rd)
    if weights is not None:
        names = ", ".join(str(i["name"]) for i in weights.items[:3])
        n = sum(s.differing_rows for s in rd.streams)
        fields = (f"every step's fields are the same within tolerance ({rd.tolerance}): {n} field(s) differ in bits" if n
                  else "every step's fields have the same bits")
        return f"different: weights differ ({names}{', ...' if weights.count > 3 else ''}); {fields}"
    s = next(x for x in rd.streams if x.verdict is DiffVerdict.DIFFERENT)
    return f"different: {s.name}: {'; '.join(s.reasons) or 'fields differ'}"


def first_difference(ra: RankFile, rb: RankFile) -> FirstDifference | None:
    """The first (step, field), in program order, whose bits differ between two rank files of
    runs with one layout (every field compared, none read but the summary tables)."""
    return compare_stream(ra, rb, Names(), lambda n: True, DiffOptions(), True).first


def diff(a: str, b: str, options: DiffOptions | None = None) -> RunDiff | RecordingDiff:
    """``replay diff A B`` as a library call: open both sides and compare them.

    A ``RunDiff`` for one part against another; a ``RecordingDiff`` when A and B are whole
    recordings of several parts each (compared part by part, by name)."""
    pairs, only_a, only_b = open_sides(a, b)
    try:
        if len(pairs) == 1 and not only_a and not only_b:
            return diff_runs(pairs[0][0], pairs[0][1], options)
        parts = {sa.part.name: diff_runs(sa, sb, options) for sa, sb in pairs}
        return _recording_diff(a, b, parts, only_a, only_b)
    finally:
        for sa, sb in pairs:
            sa.recording.close()
            sb.recording.close()


def _recording_diff(a: str, b: str, parts: dict[str, RunDiff], only_a: list[str], only_b: list[str]) -> RecordingDiff:
    verdict = worst([d.verdict for d in parts.values()] + ([DiffVerdict.INCOMPLETE] if only_a or only_b else []))
    bad = [(n, d) for n, d in parts.items() if d.exit_code]
    if verdict.exit_code == 0:
        head = f"{verdict}: all {len(parts)} parts ({', '.join(parts)})"
    elif bad:
        n, d = bad[0]
        head = f"{verdict}: {len(bad)} of {len(parts)} parts; first {n}: {d.headline}"
    else:
        missing = [f"{n} (in A only)" for n in only_a] + [f"{n} (in B only)" for n in only_b]
        common = "the common part is" if len(parts) == 1 else f"the {len(parts)} common parts are"
        head = f"{verdict}: {common} the same, but not compared: {', '.join(missing[:6])}"
    return RecordingDiff(a=a, b=b, verdict=verdict, headline=head, parts=parts, only_a=only_a, only_b=only_b)
