"""Bisection across steps: the first step where ranks, or the recording and a re-run, disagree.

Between ranks the recorded per-step digests say it all: ``first_divergence`` reads the summary
tables only. Between the recording and a re-run nothing recorded can tell, so steps are re-run:
the recording is cut at its state keyframes into intervals, each of which can be re-run on its
own (restore the keyframe, replay its steps teacher-forced, compare each step's outputs with the
recorded digests). Assuming that once the re-run departs from the recording it keeps departing
(true of a setting, a graph hazard or a kernel that differs; not of a rare nondeterministic
event, for which ``exhaustive`` scans every interval in order), a binary search over intervals
finds the first interval that departs in about log2(intervals) + 1 interval re-runs, and the
scan of that interval, which stops at its first departing step, names the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

from replay.analysis.divergence import NO_OUTPUT_FIELDS, computed_fields, field_names, first_divergence, has_fields, rank_only_fields
from replay.analysis.summary import rank_only_note
from replay.errors import CatchUpRaised, RerunError, UsageError
from replay.format.reader import Part
from replay.rerun.result import COMPLETED_FIELD, RAISED_FIELD
from replay.rerun.runner import Replayer
from replay.rerun.step import uses_relaunch
from replay.rerun.streams import stream_of, streams_of
from replay.states import ResultKind, StepsHow

__all__ = ["Interval", "StepsBisection", "bisect_steps", "bisect_steps_rerun", "intervals"]


@dataclass(slots=True)
class Interval:
    """Steps ``first``..``last``, re-run from the keyframe at ``first``: the unit of a probe."""

    first: int
    last: int
    departed: int | None = None  # the first step of the interval that left the recording
    field: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"from": self.first, "to": self.last, "departed": self.departed, "field": self.field,
                "seconds": round(self.seconds, 3)}


@dataclass(slots=True)
class StepsBisection:
    recording: str
    part: str
    how: StepsHow  # RANKS: recorded digests across ranks; RERUN: the recording against re-runs
    ranks: list[int]  # the ranks compared (how == "ranks") or the one re-run
    first: int | None  # the first step that differs
    field: str | None = None
    odd: list[int] = _field(default_factory=list)
    majority: list[int] = _field(default_factory=list)
    first_token: int | None = None  # the first step whose tokens differ (how == "ranks")
    token_field: str | None = None
    mode: str | None = None  # how == "rerun"
    probes: list[Interval] = _field(default_factory=list)
    steps_rerun: int = 0
    steps_total: int = 0
    exhaustive: bool = False
    notes: list[str] = _field(default_factory=list)
    uncompared: list[int] = _field(default_factory=list)  # re-run steps with no recorded output to compare with
    # Several models in one loop: the stream of the step found and that step's index in its
    # stream (step 5 may be the draft's step 3); ``only_stream``: the one stream bisected (--stream).
    stream: str | None = None
    stream_step: int | None = None
    only_stream: str | None = None
    token_stream: str | None = None
    token_stream_step: int | None = None
    # how == "ranks": whether a field the steps computed, and a token field, were recorded at all
    # (agreement of inputs alone, or tokens never recorded, is no verdict).
    output_fields: bool = True
    token_fields: bool = True
    # The departure's step takes these objects recorded by class name only (a cache object):
    # the re-run used the program's own, so the departure may be theirs, not the program's.
    unrecorded: list[str] = _field(default_factory=list)
    # Parameters whose rebuilt (or live) values are not the digests of the weights that ran.
    weights_differ: list[str] = _field(default_factory=list)
    # how == "ranks": fields only some ranks record from their first step on (not compared).
    rank_only: dict[str, list[int]] = _field(default_factory=dict)

    def problem(self) -> str | None:
        """Why this bisection compared nothing the steps computed (a non-zero exit), or None."""
        if self.how == StepsHow.RANKS and self.first is None and not self.output_fields:
            return f"nothing compared: {NO_OUTPUT_FIELDS}"
        return None

    def _at(self, step: int, stream: str | None, own: int | None, detail: str = "") -> str:
        """"step 5 (stream draft, its step 3; DETAIL)", as ``replay info`` names a step of a stream."""
        inside = ([f"stream {stream}, its step {own}"] if stream is not None else []) + ([detail] if detail else [])
        return f"step {step}" + (f" ({'; '.join(inside)})" if inside else "")

    def _agreement(self, who: str) -> str:
        """The verdict when the ranks never disagree: over which fields, or that none was compared."""
        only = rank_only_note({"rank_only_fields": self.rank_only})
        if not self.output_fields:
            return f"{who}: nothing compared: " + (f"no output or token field is recorded by every rank; {only}" if only else NO_OUTPUT_FIELDS)
        return f"{who} agree at every common step" + (f" in the fields they all record; {only}" if only else "")

    def verdict(self) -> str:
        if self.how == StepsHow.RANKS:
            who = (f"stream {self.only_stream}: " if self.only_stream else "") + "ranks " + ", ".join(map(str, self.ranks))
            if self.first is None:
                return self._agreement(who)
            odd = f"{self.field}: rank{'s' if len(self.odd) > 1 else ''} {', '.join(map(str, self.odd))} against " \
                  f"{', '.join(map(str, self.majority))}"
            line = f"{who} first disagree at {self._at(self.first, self.stream, self.stream_step, odd)}"
            if self.first_token is not None and self.first_token != self.first:
                line += f"; tokens first differ at {self._at(self.first_token, self.token_stream, self.token_stream_step)}"
            elif self.first_token is None and not self.token_fields:
                line += "; no token field recorded to compare"
            elif self.first_token is None:
                line += "; the tokens never differ"
            return line
        r = self.ranks[0]
        if self.first is None and self.uncompared:
            return (f"rank {r} re-run {self.mode}: no departure found in the steps compared; {len(self.uncompared)} re-run "
                    f"step(s) had no recorded output to compare with ({', '.join(map(str, self.uncompared[:8]))})")
        if self.first is None:
            if self.exhaustive:
                return f"rank {r} re-run {self.mode}: no departure from the recording found (every keyframe interval re-ran as recorded)"
            return (f"rank {r} re-run {self.mode}: no departure found in the last keyframe interval, the only one "
                    "re-run; earlier intervals were not searched (--exhaustive re-runs every one)")
        what = "it raised in the re-run, not as when recorded" if self.field == RAISED_FIELD else str(self.field)
        line = (f"rank {r} re-run {self.mode} first departs from the recording at {self._at(self.first, self.stream, self.stream_step, what)}, "
                f"found with {len(self.probes)} interval re-runs ({self.steps_rerun} of {self.steps_total} steps)")
        if self.weights_differ:
            line += (f"; but the steps ran with other weights than the re-run's ({len(self.weights_differ)} differ: "
                     f"{', '.join(self.weights_differ[:3])}{', ...' if len(self.weights_differ) > 3 else ''}): the "
                     "departure may be theirs, not the program's")
        if self.unrecorded:
            line += (f"; but the step takes {', '.join(self.unrecorded[:3])}, recorded by class name only: the re-run used "
                     "the program's own object, and the departure may be that object's contents (what the program "
                     "changes in it between steps is not re-run), not the program")
        return line

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": ResultKind.BISECT_STEPS,
            "recording": self.recording,
            "part": self.part,
            "how": self.how,
            "ranks": self.ranks,
            "first": self.first,
            "step": self.first,
            "field": self.field,
            "unrecorded_arguments": self.unrecorded,
            "weights_differ": self.weights_differ,
            "odd": self.odd,
            "majority": self.majority,
            "first_token": self.first_token,
            "token_field": self.token_field,
            "mode": self.mode,
            "probes": [p.to_json() for p in self.probes],
            "steps_rerun": self.steps_rerun,
            "steps_total": self.steps_total,
            "exhaustive": self.exhaustive,
            "notes": self.notes,
            "uncompared": self.uncompared,
            "stream": self.stream,
            "stream_step": self.stream_step,
            "only_stream": self.only_stream,
            "token_stream": self.token_stream,
            "token_stream_step": self.token_stream_step,
            "output_fields": self.output_fields,
            "token_fields": self.token_fields,
            "rank_only_fields": self.rank_only,
        }


def bisect_steps(part: Part, *, ranks: list[int] | None = None, recording: str = "", stream: str | None = None) -> StepsBisection:
    """The first step where ``ranks`` (default: all, by majority) disagree, from recorded digests.

    Several models in one loop (draft and target): the step found is named with its stream and
    its index in that stream, and each stream's own first divergence is noted; ``stream``
    bisects that stream's steps only."""
    chosen = sorted(set(ranks)) if ranks else list(part)
    for r in chosen:
        part[r]
    if len(chosen) < 2:
        raise UsageError(f"comparing ranks needs two or more (this part has {len(part)}: {', '.join(map(str, part))}); "
                         "to compare the recording with re-runs use --against-rerun")
    labels = _StreamLabels(part[chosen[0]])
    mine = labels.steps_of(stream) if stream is not None else None
    d = first_divergence(part, ranks=chosen, steps=mine)
    t = first_divergence(part, ranks=chosen, prefix="tokens.", steps=mine)
    res = StepsBisection(recording=recording, part=part.name, how=StepsHow.RANKS, ranks=chosen, first=None, only_stream=stream)
    only = rank_only_fields(part, chosen) if d is None else {}
    names = field_names(part) - set(only) if d is None or t is None else set()
    res.output_fields = d is not None or computed_fields(names)
    if only:
        res.rank_only = only
    res.token_fields = t is not None or has_fields(names, "tokens.")
    if d is not None:
        res.first, res.field, res.odd, res.majority = d.step, d.field, d.ranks, d.majority
        res.stream, res.stream_step = labels.label(d.step)
    if t is not None:
        res.first_token, res.token_field = t.step, t.field
        res.token_stream, res.token_stream_step = labels.label(t.step)
    if d is not None and len(chosen) == 2:
        res.notes.append("two ranks cannot outvote each other: the one named odd is the higher rank")
    if stream is None:
        res.notes += [labels.own_divergence(part, chosen, name) for name in labels.names]
    return res


class _StreamLabels:
    """Which stream each step of a rank belongs to (``analysis.streams.step_streams``), as
    ``replay info`` names them: "step 5 (stream draft, its step 3)"."""

    def __init__(self, rf: Any) -> None:
        from replay.analysis.streams import step_streams

        self.rank = rf.rank
        self.steps, self.index, self.names = step_streams(rf)

    def steps_of(self, stream: str) -> Any:
        if stream not in self.names:
            have = ", ".join(self.names) if self.names else "none: it recorded one model"
            raise UsageError(f"rank {self.rank} has no stream {stream!r} (streams: {have})")
        return self.steps[self.index == self.names.index(stream)]

    def label(self, step: int) -> tuple[str | None, int | None]:
        """(the stream of ``step``, its index among that stream's steps); (None, None) for one model."""
        from replay.analysis.streams import stream_position

        return stream_position(self.steps, self.index, self.names, step) or (None, None)

    def own_divergence(self, part: Part, ranks: list[int], stream: str) -> str:
        """One stream's own first divergence, bisected on its steps alone."""
        d = first_divergence(part, ranks=ranks, steps=self.steps_of(stream))
        if d is None:
            return f"stream {stream}: its ranks agree at every common step"
        _, own = self.label(d.step)
        return f"stream {stream}: first disagrees at step {d.step} (its step {own}, {d.field})"


def intervals(rp: Replayer, first: int, last: int) -> list[Interval]:
    """Steps ``first``..``last`` cut at the rank's keyframes (each interval restorable alone)."""
    if rp.spec.state is None and not len(rp.rf.keyframe_steps()):
        return [Interval(s, s) for s in range(first, last + 1)]  # no state: independent steps
    kf0, _ = rp.keyframe_for(first)
    cuts = sorted({k for k in rp.rf.keyframe_steps() if first < k <= last})
    starts = [max(first, kf0)] + cuts
    return [Interval(a, (starts[i + 1] - 1) if i + 1 < len(starts) else last) for i, a in enumerate(starts)]


def bisect_steps_rerun(
    part: Part,
    rank: int,
    *,
    mode: str = "eager",
    device: str = "cpu",
    factory: str | None = None,
    options: dict[str, Any] | None = None,
    first: int | None = None,
    last: int | None = None,
    exhaustive: bool = False,
    recording: str = "",
    stream: str | None = None,
    announce: Callable[[str], None] = lambda s: None,
    progress: Callable[..., Iterable[Any]] = lambda it, label="": it,
) -> StepsBisection:
    """The first step of ``rank`` whose re-run (in ``mode``) departs from the recording.

    Several models in one loop (draft and target) are bisected stream by stream, each on its own
    steps, and the earliest departure is the answer (``stream``: that stream alone). A recording
    with no factory is re-run inside the re-launched program (one launch per stream, scanning
    from the first step's keyframe)."""
    rf = part[rank]
    lo, hi = _step_range(rf, rank, first, last)
    res = StepsBisection(recording=recording, part=part.name, how=StepsHow.RERUN, ranks=[rank], first=None, mode=mode,
                         steps_total=hi - lo + 1, exhaustive=exhaustive)
    names = streams_of(rf)
    if stream is not None and stream not in names:
        raise UsageError(f"rank {rank} has no stream {stream!r} (streams: {', '.join(names) or 'none: it recorded one model'})")
    res.only_stream = stream
    for name in ([stream] if stream is not None else names if len(names) > 1 else [None]):
        own = [s for s in range(lo, hi + 1) if name is None or stream_of(rf, s) == name]
        if not own:
            continue
        args = _StreamBisect(part, rank, own[0], own[-1], name, mode, device, factory, dict(options or {}), exhaustive,
                             recording)
        if uses_relaunch(part, rank, own[-1], factory, name):
            hit = _relaunched_scan(args, res, announce)
        else:
            hit = _bisect_stream(args, res, announce, progress)
        if hit is not None and (res.first is None or (hit.departed is not None and hit.departed < res.first)):
            res.first, res.field = hit.departed, hit.field
    if res.first is not None and len(names) > 1:
        res.stream, res.stream_step = _StreamLabels(rf).label(res.first)
    _refuse_if_nothing_compared(res, rank)
    return res


def _step_range(rf: Any, rank: int, first: int | None, last: int | None) -> tuple[int, int]:
    steps = rf.tables.steps["step"]
    if not steps.size:
        raise UsageError(f"rank {rank} recorded no steps")
    lo = int(steps.min()) if first is None else first
    hi = int(steps.max()) if last is None else last
    if lo > hi:
        raise UsageError(f"--first {lo} is after --last {hi}")
    rf.step(lo), rf.step(hi)
    return lo, hi


def _refuse_if_nothing_compared(res: StepsBisection, rank: int) -> None:
    """No "as recorded" over steps that had nothing recorded to compare with."""
    if res.first is None and res.probes and res.steps_rerun and len(res.uncompared) >= res.steps_rerun:
        raise RerunError(f"rank {rank}: none of the {res.steps_rerun} re-run steps had a recorded output to compare with "
                         "(nothing to compare): the bisection cannot say whether the re-run departs")


@dataclass(slots=True)
class _StreamBisect:
    part: Part
    rank: int
    lo: int
    hi: int
    stream: str | None
    mode: str
    device: str
    factory: str | None
    options: dict[str, Any]
    exhaustive: bool
    recording: str


def _relaunched_scan(a: _StreamBisect, res: StepsBisection, announce: Callable[[str], None]) -> Interval | None:
    """No factory: one re-launch of the program re-runs ``lo``..``hi`` from the keyframe at
    ``lo``, comparing every step; the first that departs (catch-up or the last step) is the hit.
    Steps that take an object recorded by class name only (a cache object) are scanned one
    launch per object: the program makes each new one itself (a second ``generate()``)."""
    from replay.rerun.step import object_segments

    every = True
    for lo, hi in object_segments(a.part[a.rank], a.lo, a.hi, a.stream):
        iv, from_lo = _relaunched_scan_one(a, lo, hi, res, announce)
        every = every and from_lo
        if iv is not None:
            res.exhaustive = res.exhaustive or every
            return iv
    res.exhaustive = res.exhaustive or every  # every step from lo was compared, in order
    return None


def _relaunched_scan_one(a: _StreamBisect, lo: int, hi: int, res: StepsBisection,
                         announce: Callable[[str], None]) -> tuple[Interval | None, bool]:
    """One launch over ``lo``..``hi``: (the departure, if any; whether it began at ``lo``)."""
    from replay.rerun.runner import RerunOptions
    from replay.rerun.step import run_step

    t0 = time.perf_counter()
    settings = RerunOptions(modes=(a.mode,), device=a.device, options=a.options, recording=a.recording,
                            stream=a.stream, keyframe_at=lo)
    try:
        result = run_step(a.part, a.rank, hi, settings, announce=announce)
    except CatchUpRaised as e:
        # A step that completed when recorded raises in the re-run: the re-run departs there
        # (as a factory's scan says), and nothing after it can be reached.
        iv = Interval(e.keyframe, hi, seconds=time.perf_counter() - t0, departed=e.step, field=RAISED_FIELD)
        res.probes.append(iv)
        res.steps_rerun += e.step - e.keyframe + 1
        res.notes.append(f"catch-up step {e.step} raised in the re-run: {e}")
        return iv, e.keyframe <= lo
    run = result.modes[a.mode]
    iv = Interval(result.keyframe, hi, seconds=time.perf_counter() - t0)
    iv.departed, iv.field = _launch_departure(a, result, run, hi)
    res.probes.append(iv)
    res.steps_rerun += len(run.caught_up) + 1
    res.notes.append(f"re-run inside the re-launched program (no factory): {'stream ' + a.stream + ', ' if a.stream else ''}"
                     f"steps {result.keyframe}..{hi} scanned in one launch")
    for note in result.notes:
        if note.startswith(("started from the program's own state", "caught up from step 0", "restored the keyframes at steps")) \
                and note not in res.notes:
            res.notes.append(note)
    if iv.departed is not None:
        res.unrecorded = list(result.unrecorded)  # as ``replay step`` says it: not evidence against the program alone
        res.weights_differ = list(result.weights.differ) if result.weights is not None else []
        if not result.state_outside and not result.no_keyframes:
            _note_between_steps(res, iv, a.part[a.rank])
    res.uncompared = sorted(set(res.uncompared) | set(run.uncompared)
                            | ({hi} if run.error is not None and not run.vs_recording else set()))
    return (iv if iv.departed is not None else None), result.keyframe <= lo


def _launch_departure(a: _StreamBisect, result: Any, run: Any, hi: int) -> tuple[int | None, str | None]:
    """Where one launch's re-run departed: a catch-up step, or the last step scanned (raised
    anew, completed where it raised when recorded, or an output or collective that differs)."""
    if run.departed is not None:
        return run.departed.step, run.departed.field
    if _raised_anew(run):
        return hi, RAISED_FIELD
    if run.completed_where_it_raised:
        # Raised when recorded, completed here: a departure (as a factory's scan says), though
        # no output was recorded there to compare.
        return hi, COMPLETED_FIELD
    if run.error is None or run.vs_recording:
        problem = result.problem()
        if problem is not None and run.error is None:
            raise RerunError(f"rank {a.rank}: step {hi} could not be re-run to bisect: {problem}")
        bad = next((k for k, c in run.vs_recording.items() if not c.equal), run.collective_departure)
        if bad is not None:
            return hi, bad
    return None, None


def _raised_anew(run: Any) -> bool:
    """The step raised in the re-run where it completed, or raised another kind of error, when recorded."""
    if run.error is None:
        return False
    return run.recorded_error is None or run.error.split(":")[0] != run.recorded_error.split(":")[0]


def _bisect_stream(a: _StreamBisect, res: StepsBisection, announce: Callable[[str], None],
                   progress: Callable[..., Iterable[Any]]) -> Interval | None:
    """With a factory: intervals between keyframes, binary-searched (or scanned in order)."""
    rp = Replayer(a.part, a.rank, mode=a.mode, device=a.device, factory=a.factory, options=a.options, stream=a.stream)
    ivs = intervals(rp, a.lo, a.hi)
    rp.check(ivs[0].first, a.hi)
    if rp.factory_name is not None:
        announce(f"importing factory {rp.factory_name} (named by the recording)" if a.factory is None else f"importing factory {a.factory} (--factory)")
    done: dict[int, Interval] = {}

    def probe(i: int) -> Interval:
        if i in done:
            return done[i]
        iv = ivs[i]
        t0 = time.perf_counter()
        dep = rp.scan(iv.first, iv.last)
        iv.seconds = time.perf_counter() - t0
        res.uncompared = sorted(set(res.uncompared) | set(rp.uncompared))
        ran_to = dep.step if dep is not None else iv.last
        res.steps_rerun += ran_to - (rp.keyframe if rp.keyframe is not None else iv.first) + 1
        if dep is not None:
            iv.departed, iv.field = dep.step, dep.field
        res.probes.append(iv)
        done[i] = iv
        return iv

    try:
        rp.build()
        hit = _first_departing(ivs, probe, done, exhaustive=a.exhaustive, res=res,
                               progress=lambda it: progress(it, label=f"rank {a.rank}: re-running {len(ivs)} intervals"))
    finally:
        rp.close()
    if hit is not None:
        _note_unchecked(res, ivs, hit)
        _note_between_steps(res, hit, a.part[a.rank])
    return hit


def _note_between_steps(res: StepsBisection, hit: Interval, rf: Any) -> None:
    """A departure after the interval's keyframe, with the recorded inputs fed: the same remedy
    ``replay step`` gives, when the program changes the model's state between steps; before it,
    what the re-run ran otherwise (the environment), and never the remedy the recording already
    has (a keyframe at the departing step)."""
    if hit.departed is None or res.unrecorded or res.weights_differ:
        return
    from replay.rerun.runner import environment_moved

    moved = environment_moved(rf)
    if moved:
        res.notes.append(f"the re-run departed at step {hit.departed}; the environment here differs from the recorded "
                         f"program's in {', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}: set them as they were "
                         "if the program reads them, and bisect again")
        return
    if hit.departed in set(rf.keyframe_steps()):
        res.notes.append(f"the re-run departed at step {hit.departed}, from the keyframe taken at that step: the state "
                         "it holds is not what makes the step differ (what the step reads outside its model and "
                         "arguments, or a nondeterministic computation: replay step --repeat 3 tells)")
        return
    if hit.first < hit.departed:
        res.notes.append(f"the re-run departed at step {hit.departed}, after the keyframe at step {hit.first} restored the "
                         "recorded state: if the program changes the model's state between steps (a beam search reordering "
                         "its cache, a reset), a keyframe every step restores it: replay record --keyframe-every 1")


def _first_departing(ivs: list[Interval], probe: Callable[[int], Interval], done: dict[int, Interval], *, exhaustive: bool,
                     res: StepsBisection, progress: Callable[[Iterable[int]], Iterable[int]]) -> Interval | None:
    """The first interval whose re-run departs: in order (``exhaustive``), or by binary search
    assuming a departure persists (the last interval is probed first: none there, none at all)."""
    if exhaustive:
        return next((done[i] for i in progress(range(len(ivs))) if probe(i).departed is not None), None)
    if probe(len(ivs) - 1).departed is None:
        res.notes.append("the last interval re-ran as recorded, so the search assumed no departure; but each "
                         "interval starts from its own keyframe, which restores the recorded state, so a departure in an "
                         "earlier interval (a step that computed otherwise once, or only now and then) does not carry into "
                         "the last one: --exhaustive re-runs every interval")
        return None
    a, b = 0, len(ivs) - 1  # invariant: interval b departs
    while a < b:
        mid = (a + b) // 2
        if probe(mid).departed is not None:
            b = mid
        else:
            a = mid + 1
    return done[b]


def _note_unchecked(res: StepsBisection, ivs: list[Interval], hit: Interval) -> None:
    earlier = [iv for iv in res.probes if iv.first < hit.first]
    if earlier and all(iv.departed is None for iv in earlier) and not res.exhaustive:
        unchecked = [iv for iv in ivs if iv.last < hit.first and iv not in res.probes]
        if unchecked:
            res.notes.append(f"{len(unchecked)} earlier interval(s) were not re-run (the search assumes a departure persists)")
