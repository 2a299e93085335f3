"""replay from Python: what every ``replay`` command does, as functions.

One calling convention: a :class:`~replay.format.reader.Recording` (whole-recording questions:
``info``, ``verify``, ``report``) or a :class:`~replay.format.reader.Part` (questions about one
run: ``step``, the bisections) goes in, a typed result comes out. Results print as their verdict
(``str(result)`` is the first line the CLI prints) and serialise with ``to_json()``. Nothing here
prints or exits: errors are :class:`~replay.errors.ReplayError` subclasses carrying the CLI's exit
code. The CLI (``replay.cli``) parses, calls one of these and renders.

This module imports neither torch nor the recorder at import time, so ``replay info`` starts fast;
what needs them imports them when called. See docs/python-api.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.analysis.choose import choose_part, odd_rank, pair_step, rank_and_step, recorded_device
from replay.errors import RecordingDamaged
from replay.format.reader import Part, Recording
from replay.states import CheckState

if TYPE_CHECKING:
    from replay.analysis.verify import RankCheck
    from replay.bisect.config import ConfigBisection, ConfigBisectSettings, ProbeRecord
    from replay.bisect.layers import LayersBisection
    from replay.bisect.steps import StepsBisection
    from replay.format.seal import SealResult
    from replay.record.config import RecordConfig
    from replay.record.wrapper import RecordResult
    from replay.report.data import Report
    from replay.rerun.runner import StepRerun

__all__ = [
    "InfoResult",
    "PartInfo",
    "RecordOutcome",
    "ReportResult",
    "RerunOptions",
    "SealOutcome",
    "VerifyResult",
    "bisect_config",
    "bisect_layers",
    "bisect_runs",
    "bisect_steps",
    "bisect_steps_rerun",
    "choose_part",
    "default_device",
    "detect_node_rank",
    "info",
    "make_recording_dir",
    "make_report",
    "record_run",
    "seal",
    "step",
    "step_ranks",
    "verify",
]

Announce = Callable[[str], None]
Progress = Callable[..., Iterable[Any]]


def _quiet(_: str) -> None:
    return None


def _no_progress(it: Iterable[Any], label: str = "") -> Iterable[Any]:
    return it


def _recording_of(part: Part) -> str:
    return str(part.path.parent)


# -- info -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class PartInfo:
    """One part (one run of the command) of a recording, as ``info`` lists it."""

    name: str
    world_size: int
    diverged: bool | None  # None: none of its rank files can be read
    token_diverged: bool | None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "world_size": self.world_size, "diverged": self.diverged,
                               "token_diverged": self.token_diverged}
        if self.problem is not None:
            out["problem"] = self.problem
        return out


@dataclass(kw_only=True, slots=True)
class InfoResult:
    """What ``replay info`` shows: the parts, and the summary of the part shown
    (``replay.analysis.summary.summarize_part``: ranks, first divergences, tuner and kernel
    differences)."""

    recording: str
    command: Any  # from the manifest, as written (data from disk: any JSON type)
    parts: list[PartInfo]
    summary: dict[str, Any]
    # How the recorded command ended (the manifest's): its exit code, and the signal that ended
    # it; None where the manifest does not say (a recording still going, or no manifest).
    command_exit_code: int | None = None
    command_signal: int | None = None

    @property
    def part(self) -> str:
        return str(self.summary["part"])

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        return self.summary.get("first_divergence")

    @property
    def first_token_divergence(self) -> dict[str, Any] | None:
        return self.summary.get("first_token_divergence")

    @property
    def unreadable_ranks(self) -> list[dict[str, Any]]:
        return list(self.summary.get("unreadable_ranks") or [])

    @property
    def exit_code(self) -> int:
        """0, or the damaged-recording code when some rank files of the part shown cannot be read."""
        return RecordingDamaged.exit_code if self.unreadable_ranks else 0

    def to_json(self) -> dict[str, Any]:
        from replay.analysis.summary import verdict_line

        data = {"recording": self.recording, "command": self.command, "command_exit_code": self.command_exit_code,
                "command_signal": self.command_signal, "parts": [p.to_json() for p in self.parts], **self.summary}
        return {**data, "verdict": verdict_line(data)}  # the first line of ``replay info``


def info(recording: Recording, part: str | None = None) -> InfoResult:
    """Summarise ``recording``: its parts, and for ``part`` (default: the only one, or the first
    that diverged) the ranks, the first divergence and what differs around it."""
    from replay.analysis.summary import summarize_part

    chosen = choose_part(recording, part)
    summary = summarize_part(chosen)
    parts = []
    for name, p in recording.items():
        try:
            s = summary if p is chosen else summarize_part(p, with_details=False)
        except RecordingDamaged as e:  # another part, none of whose rank files can be read
            parts.append(PartInfo(name=name, world_size=p.world_size, diverged=None, token_diverged=None, problem=str(e)))
            continue
        parts.append(PartInfo(name=name, world_size=p.world_size, diverged=s["first_divergence"] is not None,
                              token_diverged=s["first_token_divergence"] is not None))
    m = recording.manifest
    return InfoResult(recording=str(recording.path), command=m.get("command"), parts=parts, summary=summary,
                      command_exit_code=_int_or_none(m.get("exit_code")), command_signal=_int_or_none(m.get("signal")))


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# -- verify ---------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class VerifyResult:
    """Every rank file checked; ``state`` is the worst of them."""

    recording: str
    checks: list[RankCheck]
    notes: list[str] = field(default_factory=list)  # what the rank files' checks do not cover

    @property
    def intact(self) -> bool:
        return all(c.intact for c in self.checks)

    @property
    def state(self) -> CheckState:
        if self.intact:
            return CheckState.INTACT
        if all(c.state != CheckState.DAMAGED for c in self.checks):
            return CheckState.INCOMPLETE
        return CheckState.DAMAGED

    @property
    def exit_code(self) -> int:
        return 0 if self.intact else RecordingDamaged.exit_code

    def __str__(self) -> str:
        return {CheckState.INTACT: "recording is intact",
                CheckState.INCOMPLETE: "recording is incomplete: what it holds is whole, the end of the run is missing",
                CheckState.DAMAGED: "recording is damaged"}[self.state]

    def to_json(self) -> dict[str, Any]:
        return {"recording": self.recording, "intact": self.intact, "state": str(self.state.value),
                "ranks": [c.to_json() for c in self.checks], "notes": self.notes}


def verify(recording: Recording, *, payload: bool = True) -> VerifyResult:
    """Check every rank file of ``recording``; ``payload=False`` checks structure only."""
    from replay.analysis.verify import verify_recording

    notes = [] if recording.manifests else [
        "no manifest.json: the command, the versions and the host facts that info and diff show are not in the "
        "recording (removed, or never written); only the rank files were checked"]
    return VerifyResult(recording=str(recording.path), checks=verify_recording(recording, payload=payload), notes=notes)


# -- report ---------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ReportResult:
    """The report page written, and the data it was built from."""

    path: Path
    data: Report

    @property
    def exit_code(self) -> int:
        return RecordingDamaged.exit_code if self.data.summary.get("unreadable_ranks") else 0

    def __str__(self) -> str:
        return str(self.path)

    def to_json(self) -> dict[str, Any]:
        return {"report": str(self.path), **self.data.to_json()}


def make_report(recording: Recording, part: str | None = None, *, output: Path | None = None,
                against: str | None = None) -> ReportResult:
    """Build the HTML report of ``recording`` and write it to ``output`` (default:
    ``<recording>/report.html``); ``against`` (``PATH``, ``PATH:PART`` or ``PATH:PART/RANK``)
    leads the page with ``replay diff`` of this run against that one."""
    from replay.report import build_report, write_report

    data = build_report(recording, part)
    if against is not None:  # issue 17
        from replay.analysis.diff import diff

        data.diff = diff(f"{recording.path}:{data.part}", against).to_json()
    return ReportResult(path=write_report(data, output), data=data)


# -- seal -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class SealOutcome:
    """The journals sealed (or not) in each part, and those still being written."""

    recording: str
    sealed: list[tuple[str, SealResult]] = field(default_factory=list)
    live: list[tuple[str, str]] = field(default_factory=list)  # (part, journal file name)

    @property
    def exit_code(self) -> int:
        return RecordingDamaged.exit_code if any(r.error for _, r in self.sealed) else 0

    def to_json(self) -> dict[str, Any]:
        rows: list[dict[str, Any]] = [{"part": p, "rank": r.rank, "steps": r.steps, "complete": r.complete,
                                       "problem": r.problem, "error": r.error} for p, r in self.sealed]
        rows += [{"part": p, "journal": j, "live": True} for p, j in self.live]
        return {"recording": self.recording, "sealed": rows}


def seal(path: Path) -> SealOutcome:
    """Seal every rank journal under the recording directory ``path`` whose process has ended.

    Takes a path, not a ``Recording``: a recording whose journals are not sealed yet may not open.
    """
    from replay.format.seal import journal_is_live, seal_part
    from replay.trust import seal_sign_after

    path = Path(path)
    if not path.is_dir():
        raise RecordingDamaged(f"{path} is a file, not a recording: give the directory `replay record` wrote")
    out = SealOutcome(recording=str(path))
    sign_after = seal_sign_after(path)  # issue 16: sign only what this user's `replay record` started
    for part in sorted(p for p in path.iterdir() if p.is_dir()):
        out.sealed += [(part.name, r) for r in seal_part(part, sign_after=sign_after)]
        out.live += [(part.name, j.name) for j in sorted(part.glob("rank-*.journal")) if journal_is_live(j)]
    return out


# -- record ---------------------------------------------------------------------------------


_NODE_RANK_ENV = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def detect_node_rank(cmd: list[str], environ: Mapping[str, str] | None = None) -> int | None:
    """Which node of a multi-node run this launcher is: torchrun's ``--node-rank N`` (or
    ``--node_rank=N``) in ``cmd``, else ``GROUP_RANK``, ``NODE_RANK`` or ``SLURM_NODEID``."""
    for i, a in enumerate(cmd):
        for flag in ("--node-rank", "--node_rank"):
            if a == flag and i + 1 < len(cmd) and cmd[i + 1].isdigit():
                return int(cmd[i + 1])
            if a.startswith(flag + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
    env = os.environ if environ is None else environ
    for var in _NODE_RANK_ENV:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def make_recording_dir(cmd: list[str], *, out: Path | None, root: Path, name: str | None = None) -> Path:
    """``out`` (created), or a new ``<root>/<time>-<name>`` directory; a ``UsageError`` naming the
    place when it cannot be written (nothing has run yet)."""
    from replay.errors import UsageError
    from replay.record.wrapper import recording_dir_for

    try:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            return out
        return recording_dir_for(cmd, root, name)
    except OSError as e:
        where = out if out is not None else root
        raise UsageError(
            f"cannot write the recording to {where} ({e.strerror or e}): choose a writable directory with --out"
        ) from None


@dataclass(kw_only=True, slots=True)
class RecordOutcome:
    """A recorded command: how it ended, and ``info`` of what it recorded (None, with
    ``problem`` set, when nothing readable was recorded)."""

    path: Path
    result: RecordResult
    info: InfoResult | None
    problem: str | None = None

    @property
    def exit_code(self) -> int:
        return self.result.exit_code  # the recorded command's own: replay record is transparent

    def to_json(self) -> dict[str, Any]:
        return {"recording": str(self.path), "exit_code": self.result.exit_code, "signal": self.result.signal,
                "still_live": self.result.still_live, "info": self.info.to_json() if self.info else None}


def record_run(cmd: list[str], settings: RecordConfig, *, out: Path | None = None, root: Path = Path("recordings"),
           name: str | None = None, node_rank: int | None = None, grace_s: float = 30.0) -> RecordOutcome:
    """Run ``cmd`` and record every rank of every Python process it starts; then summarise."""
    from replay.errors import ReplayError, UsageError
    from replay.record.wrapper import record_command

    if not cmd:
        raise UsageError("no command to record: replay record -- CMD ...")
    path = make_recording_dir(cmd, out=out, root=root, name=name)
    node = node_rank if node_rank is not None else detect_node_rank(cmd)
    try:
        result = record_command(cmd, settings, out=path, node=node, grace_s=grace_s)
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}") from None
    try:
        with Recording(path) as rec:
            return RecordOutcome(path=path, result=result, info=info(rec))
    except ReplayError as e:
        return RecordOutcome(path=path, result=result, info=None, problem=str(e))


# -- re-runs --------------------------------------------------------------------------------


def default_device(part: Part) -> str:
    """``cuda:0`` when the recorded target ran on a GPU and one is here, else ``cpu``."""
    recorded = recorded_device(part)
    if recorded and recorded.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return "cuda:0"
    return "cpu"


@dataclass(kw_only=True, slots=True)
class RerunOptions:
    """How a step is re-run; the options of ``replay step`` and ``replay bisect`` map onto these."""

    modes: tuple[str, ...] = ("eager",)
    """Re-run modes, ``eager`` and/or ``cudagraph``; a bisection uses the first."""
    device: str | None = None
    """``cpu`` or ``cuda:N``; None: :func:`default_device`."""
    repeat: int = 1
    """Run the step this many times from the same state (a nondeterminism check)."""
    factory: str | None = None
    """``module:qualname`` that rebuilds the target, instead of the one the recording names."""
    toggles: dict[str, Any] = field(default_factory=dict)
    """Target toggles set in every re-run (``--set key=value``)."""

    def __post_init__(self) -> None:
        from replay.errors import UsageError

        bad = [m for m in self.modes if m not in ("eager", "cudagraph")]
        if bad or not self.modes:
            raise UsageError(f"mode {', '.join(bad) or '(none)'}: use eager, cudagraph or both")
        if self.repeat < 1:
            raise UsageError("--repeat must be at least 1")

    def device_for(self, part: Part) -> str:
        return self.device or default_device(part)


def step(part: Part, rank: int, step: int, options: RerunOptions | None = None, *, announce: Announce = _quiet,
         progress: Progress = _no_progress) -> StepRerun:
    """Re-run ``step`` of ``rank`` from its nearest keyframe, in each mode, and compare it with
    the recording (``replay.rerun.runner.rerun_step``)."""
    from replay.rerun.runner import RerunOptions as Settings
    from replay.rerun.step import run_step

    o = options or RerunOptions()
    part[rank].step(step)
    # With no factory recorded, run_step re-launches the recorded program (it is its own factory).
    settings = Settings(modes=tuple(o.modes), device=o.device_for(part), repeat=o.repeat, factory=o.factory,
                        options=dict(o.toggles), recording=_recording_of(part))
    return run_step(part, rank, step, settings, announce=announce, progress=progress)


def step_ranks(part: Part, ranks: list[int], step: int, options: RerunOptions | None = None, *,
               devices: str | None = None) -> list[dict[str, Any]]:
    """Re-run ``step`` on each of ``ranks``, one process each (live collectives when all ranks
    are re-run on distinct devices); one JSON result per rank."""
    from replay.rerun.multi import rerun_ranks

    o = options or RerunOptions()
    return rerun_ranks(part.path.parent, part.name, ranks, step, modes=list(o.modes), devices=devices, repeat=o.repeat,
                       factory=o.factory, options=dict(o.toggles))


# -- bisections -----------------------------------------------------------------------------


def bisect_steps(part: Part, *, ranks: list[int] | None = None, stream: str | None = None) -> StepsBisection:
    """The first step where ``ranks`` (default: all, by majority) disagree, from the recorded
    digests; ``stream``: that model's steps only (several models in one loop)."""
    from replay.bisect.steps import bisect_steps as _bisect

    return _bisect(part, ranks=ranks, recording=_recording_of(part), stream=stream)


def bisect_steps_rerun(part: Part, rank: int | None = None, options: RerunOptions | None = None, *,
                       exhaustive: bool = False, stream: str | None = None, announce: Announce = _quiet,
                       progress: Progress = _no_progress) -> StepsBisection:
    """The first step of ``rank`` (default: the odd rank at the first divergence) whose re-run
    departs from the recording; ``stream``: that model's steps only."""
    from replay.bisect.steps import bisect_steps_rerun as _bisect

    o = options or RerunOptions()
    if rank is None:
        chosen = odd_rank(part)
        rank = chosen.rank
        announce(chosen.why or "")
    return _bisect(part, rank, mode=o.modes[0], device=o.device_for(part), factory=o.factory, options=dict(o.toggles),
                   exhaustive=exhaustive, recording=_recording_of(part), stream=stream, announce=announce, progress=progress)


def bisect_layers(part: Part, between: str, *, step: int | None = None, rank: int | None = None,
                  mode: str | None = None, options: RerunOptions | None = None, modules: list[str] | None = None,
                  context: int = 3, announce: Announce = _quiet, progress: Progress = _no_progress) -> LayersBisection:
    """Re-run ``step`` as the two executions of ``between`` (``eager,cudagraph``,
    ``rank:0,rank:3``, ``recorded,rerun``) with taps on every module; name the first module
    whose output differs. Between two ranks, ``step`` defaults to where they first disagree."""
    from replay.bisect.layers import bisect_layers as _bisect
    from replay.bisect.layers import parse_between, recorded_mode

    o = options or RerunOptions()
    toggles = dict(o.toggles)
    ranks = list(part)
    if rank is None and len(ranks) == 1:
        rank = ranks[0]  # one rank: the one whose step is re-run
    if step is None:
        a0, b0 = parse_between(between, rank=rank, mode=mode, recorded=lambda r: "eager", options=toggles)
        chosen = pair_step(part, a0.rank, b0.rank)
        step = chosen.step
        announce(chosen.why or "")
    assert step is not None
    at = step
    a, b = parse_between(between, rank=rank, mode=mode, recorded=lambda r: recorded_mode(part, r, at), options=toggles)
    _needs_factory(part, sorted({a.rank, b.rank}), step, o.factory, "bisect layers (its taps go on the rebuilt model)")
    announce(f"re-running step {step} as {a.label} and as {b.label}, with taps on every module")
    return _bisect(part, step, a, b, modules=modules, device=o.device_for(part), factory=o.factory, context=context,
                   recording=_recording_of(part), progress=progress)


def bisect_runs(part_a: Part, part_b: Part, *, rank_a: int | None = None, rank_b: int | None = None,
                step: int | None = None, mode: str | None = None, options: RerunOptions | None = None,
                modules: list[str] | None = None, context: int = 3, names: tuple[str, str] = ("A", "B"),
                announce: Announce = _quiet, progress: Progress = _no_progress) -> LayersBisection:
    """Two runs, module by module (``replay bisect layers --between run:A,run:B``): re-run ``step``
    of rank ``rank_a`` of ``part_a`` and of rank ``rank_b`` of ``part_b``, each from its own
    recording, with taps on every module; name the module that makes the difference and the
    first whose outputs differ, and the parameters whose bits differ between the runs. When the
    step's inputs or carried-over state already differ, run B's model is also run on run A's data,
    so that a module is compared from equal inputs (``result.equal_inputs``).

    Ranks default to the first of each part; ``step`` to the first step whose recorded bits
    differ between the two (a UsageError when none does). ``names``: how the two runs are called."""
    from replay.analysis.diff import first_difference
    from replay.bisect.layers import Side, recorded_mode
    from replay.bisect.layers import bisect_runs as _bisect
    from replay.errors import UsageError

    o = options or RerunOptions()
    ra = next(iter(part_a)) if rank_a is None else rank_a
    rb = next(iter(part_b)) if rank_b is None else rank_b
    where_a, where_b = f"{_recording_of(part_a)}:{part_a.name}/{ra}", f"{_recording_of(part_b)}:{part_b.name}/{rb}"
    if step is None:
        first = first_difference(part_a[ra], part_b[rb])
        if first is None:
            raise UsageError(f"{where_a} and {where_b} record the same bits at every step they share: give --step S")
        step = first.step
        announce(f"bisecting step {step}, where the two runs first differ ({first.field})")
    sides = []
    for label, part, rank, where in ((names[0], part_a, ra, where_a), (names[1], part_b, rb, where_b)):
        m = mode or recorded_mode(part, rank, step)  # each run re-run as it ran, unless --mode
        sides.append(Side(f"run {label}", rank, m, dict(o.toggles), part=part, where=where))
    announce(f"re-running step {step} of run {names[0]} ({where_a}) and run {names[1]} ({where_b}), with taps on every module")
    return _bisect(step, sides[0], sides[1], modules=modules, device=o.device_for(part_a), factory=o.factory,
                   context=context, recording=_recording_of(part_a), progress=progress)


def _needs_factory(part: Part, ranks: list[int], step: int, factory: str | None, what: str) -> None:
    """One clear line, before anything runs, when a recording with no factory is asked for what
    only a factory can give (a re-launched program takes no taps and no toggles)."""
    from replay.errors import FactoryError
    from replay.rerun.step import uses_relaunch

    if any(uses_relaunch(part, r, step, factory) for r in ranks):
        raise FactoryError(f"{what} needs a factory, and this recording names none: pass --factory MODULE:QUALNAME "
                           "(`replay step` and `replay bisect steps --against-rerun` re-launch the recorded program instead)")


def bisect_config(part: Part, settings: ConfigBisectSettings, *, announce: Announce = _quiet,
                  on_probe: Callable[[ProbeRecord], None] | None = None) -> ConfigBisection:
    """The smallest set of toggles that makes a step match (``replay.bisect.config``).

    ``settings.rank`` / ``settings.step`` left as None come from the first divergence."""
    import dataclasses

    from replay.bisect.config import bisect_config as _bisect

    chosen = rank_and_step(part, settings.rank, settings.step)
    if chosen.why:
        announce(chosen.why)
    s = dataclasses.replace(settings, rank=chosen.rank, step=chosen.step)
    _needs_factory(part, [chosen.rank], chosen.step, s.factory, "bisect config (its toggles are passed to the factory)")
    return _bisect(part.path.parent, part.name, s, announce=announce, on_probe=on_probe or (lambda p: None))
