"""Re-run one step of one rank, whichever way the recording allows: with the factory it names
(or ``--factory``), or, when it names none, inside the recorded program started again
(``replay.rerun.relaunch``). The CLI (``replay step``), ``replay.api.step`` and the bisections
call this, and all get the same typed ``StepRerun`` back."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable

from replay.textsafe import a_or_an
from replay.core.structure import UNRECORDED_ARG
from replay.errors import UsageError
from replay.format.reader import Part, RankFile
from replay.format.schema import RunMode
from replay.rerun.relaunch import RelaunchSpec, needs_relaunch, recorded_args, relaunch_step
from replay.rerun.result import StepRerun
from replay.rerun.runner import RerunOptions, check_device, default_modes, rerun_step
from replay.rerun.streams import check_stream, target_info

__all__ = ["default_device", "uses_relaunch", "run_step"]

SET_IGNORED = "--set has no effect on a re-launched program (it has no factory to pass it to)"


def default_device(recorded: str | None) -> str:
    """cuda:0 for a step recorded on a GPU when this machine has one; else the CPU."""
    import torch

    if recorded and recorded.startswith("cuda") and torch.cuda.is_available():
        return "cuda:0"
    return "cpu"


def uses_relaunch(part: Part, rank: int, step: int, factory: str | None, stream: str | None = None) -> bool:
    """Whether a re-run of ``step`` needs the recorded program itself (no factory to rebuild it)."""
    rf = part[rank]
    return factory is None and needs_relaunch(target_info(rf, check_stream(rf, step, stream)), recorded_args(rf, step))


def run_step(part: Part, rank: int, step: int, settings: RerunOptions, *,
             announce: Callable[[str], None] = lambda s: None,
             progress: Callable[..., Iterable[int]] = lambda it, label="": it) -> StepRerun:
    """Re-run ``step`` of ``rank``; ``settings.device`` and ``settings.modes`` left empty become
    what the recording and this machine can run."""
    rf = part[rank]
    rf.step(step)
    target: Any = rf.attrs.get("target") or {}
    settings.device = settings.device or default_device(target.get("device") if isinstance(target, dict) else None)
    stream = check_stream(rf, step, settings.stream)
    relaunch = settings.make_target is None and uses_relaunch(part, rank, step, settings.factory, stream)
    chosen_modes = bool(settings.modes)
    if not settings.modes:
        settings.modes = tuple(default_modes(part, rank, step, settings.device, relaunch=relaunch))
    if not relaunch:
        result = rerun_step(part, rank, step, settings, announce=announce, progress=progress)
        result.unrecorded = unrecorded_arguments(rf, result.keyframe, step)
        result.notes += not_compared(rf, step)
        return result
    check_device(settings.device)  # what the re-run inside the program would refuse, before starting it
    check_graph_mode(rf, settings.modes, settings.device)
    # No factory: the recorded program, started again in replay mode, is its own factory.
    # An object argument recorded by class name only (a KV cache object) is the program's own,
    # taken at the recording's step 0: only the steps before this one bring it here, so the
    # re-run catches up from step 0, not from a later keyframe.
    objects = unrecorded_arguments(rf, 0, step)
    take_at = objects_since(rf, step, stream) if objects else None
    if take_at:
        # The program made the object the step takes at step ``take_at`` (a second
        # ``generate()``'s cache): it runs the steps before that itself, and the re-run starts
        # from its own state there. That state is changed by a run: one mode.
        settings.modes = one_mode(settings.modes if chosen_modes else settings.modes[:1], step, objects)
    spec = RelaunchSpec(recording=settings.recording, part=part.name, rank=rank, step=step, modes=list(settings.modes),
                        device=settings.device, repeat=settings.repeat, options=settings.options, stream=stream,
                        keyframe_at=0 if objects else settings.keyframe_at, take_at=take_at or None)
    result = relaunch_step(spec, target.get("launch") or {}, world=part.world_size, announce=announce)
    if spec.keyframe_at is None and _keyframe_lacks_state(result):
        result = _from_step_zero(spec, result, target.get("launch") or {}, part.world_size, announce)
    result.unrecorded = unrecorded_arguments(rf, result.keyframe, step)
    result.notes += not_compared(rf, step)
    if take_at:
        result.notes.append(f"started from the program's own state at step {take_at}: {', '.join(objects[:3])} is the "
                            f"program's own object, recorded by class name only and new at step {take_at}; the program "
                            "ran the steps before it itself")
    elif objects and step > 0:
        result.notes.append(f"caught up from step 0: {', '.join(objects[:3])} is the program's own object, recorded by "
                            "class name only, which the steps before this one bring to its state here")
    if settings.options:
        result.notes.append(SET_IGNORED)
    return result


def _departed_at_own_keyframe(result: StepRerun) -> bool:
    """The re-run left the recording at the step of the keyframe it restored: the keyframe does
    not hold all the state the step reads (a module global, an object the loop keeps)."""
    return result.keyframe > 0 and not result.live_start and any(
        m.departed is not None and m.departed.step == result.keyframe for m in result.modes.values())


def _keyframe_lacks_state(result: StepRerun) -> bool:
    """The re-run from the step's keyframe left the recording at that keyframe's step."""
    return _departed_at_own_keyframe(result) or _unreproduced_at_its_keyframe(result)


def _unreproduced_at_its_keyframe(result: StepRerun) -> bool:
    """The step is a keyframe's own step, re-run from that keyframe, and did not reproduce: with
    no catch-up step before it, the keyframe's missing state shows only in the step itself."""
    return result.keyframe > 0 and result.keyframe == result.step and not result.live_start and any(
        m.error is None and m.recorded_error is None and not m.reproduces() for m in result.modes.values())


def _from_step_zero(spec: RelaunchSpec, first: StepRerun, launch: dict[str, Any], world: int,
                    announce: Callable[[str], None]) -> StepRerun:
    """The step again, caught up from step 0 in the re-launched program (whose own state outside
    the keyframes then runs on as it did), restoring each keyframe as catch-up reaches it, as
    ``bisect steps --against-rerun`` does: the two then agree."""
    own = first.keyframe == first.step
    announce(f"step {first.step} did not reproduce from its own keyframe: re-running from step 0" if own else
             f"the keyframe at step {first.keyframe} departed at its own step: re-running from step 0")
    again = relaunch_step(replace(spec, keyframe_at=0), launch, world=world, announce=announce)
    note = (f"from the keyframe at step {first.keyframe} the re-run departed at that step itself, so the step was re-run "
            "from step 0, the program's own state running on through the steps before it")
    if own:
        return _own_keyframe_or_step_zero(first, again)
    if _departed_by(again, first.keyframe):
        # From step 0 too: the keyframe is not what made it depart.
        again.notes.append(note + f"; it departs from step 0 as well, by step {first.keyframe}")
    else:
        again.notes.append(note + ": the keyframe does not hold all the state the step reads (name the rest with replay "
                           "record --state, unless it lies outside the step's object: a module global)")
    return again


def _own_keyframe_or_step_zero(first: StepRerun, again: StepRerun) -> StepRerun:
    """A keyframe's own step, re-run from that keyframe (``first``) and from step 0 (``again``):
    the re-run from step 0 where it reproduces (the keyframe lacks state), else the first, whose
    verdict and advice are about the step itself, with what step 0 gave."""
    kf = first.keyframe
    if not _departed_by(again, kf - 1) and all(m.reproduces() for m in again.modes.values()):
        again.notes.append(f"re-run from its own keyframe (step {kf}) the step did not reproduce, so it was re-run from "
                           "step 0, the program's own state running on through the steps before it: the keyframe does "
                           "not hold all the state the step reads (name the rest with replay record --state, unless it "
                           "lies outside the step's object: a module global)")
        return again
    dep = next((m.departed for m in again.modes.values() if m.departed is not None), None)
    how = f"it departs from the recording by step {dep.step}" if dep is not None else "it does not reproduce either"
    first.notes.append(f"re-run from step 0 as well (the program's own state running on through the steps before it), "
                       f"{how}: the keyframe at step {kf} is not what makes the step differ")
    return first


def _departed_by(result: StepRerun, step: int) -> bool:
    return any(m.departed is not None and m.departed.step <= step for m in result.modes.values())


def not_compared(rf: RankFile, step: int) -> list[str]:
    """A note naming what the step gave the recorder that it could not record (a nested or
    sparse output): the re-run's verdicts do not cover it."""
    try:
        fields = recorded_args(rf, step).get(UNRECORDED_ARG)
    except Exception:  # noqa: BLE001 - no arguments recorded for the step
        return []
    if not isinstance(fields, dict) or not fields:
        return []
    named = ", ".join(f"{k} ({a_or_an(v)})" for k, v in sorted(fields.items()) if isinstance(k, str) and isinstance(v, str))
    return [f"not compared: {named}: the recorder could not record it (its values are not a dense array)"] if named else []


def _object_keys(rf: RankFile, s: int) -> tuple:
    """Which objects recorded by class name only step ``s`` took (name, ordinal)."""
    args = recorded_args(rf, s)
    return tuple(sorted((str(k), v.get("object")) for k, v in args.items()
                        if isinstance(v, dict) and isinstance(v.get("unrecorded"), str)))


def objects_since(rf: RankFile, step: int, stream: str | None) -> int:
    """The first step of the stream from which on, up to ``step``, every step took the same
    objects recorded by class name only (a recording without their ordinals: 0)."""
    from replay.rerun.streams import stream_of

    want = _object_keys(rf, step)
    first = step
    for s in range(step - 1, -1, -1):
        if stream is not None and stream_of(rf, s) != stream:
            continue
        if _object_keys(rf, s) != want:
            break
        first = s
    return first


def object_segments(rf: RankFile, lo: int, hi: int, stream: str | None) -> list[tuple[int, int]]:
    """``lo``..``hi`` cut where the objects recorded by class name only that the stream's steps
    take change (each piece: steps one re-launch can re-run from the program's own objects)."""
    from replay.rerun.streams import stream_of

    if not unrecorded_arguments(rf, lo, hi):
        return [(lo, hi)]
    pieces: list[tuple[int, int]] = []
    start, prev, last = lo, None, lo
    for s in range(lo, hi + 1):
        if stream is not None and stream_of(rf, s) != stream:
            continue
        keys = _object_keys(rf, s)
        if prev is not None and keys != prev:
            pieces.append((start, last))
            start = s
        prev, last = keys, s
    pieces.append((start, hi))
    return pieces


def one_mode(modes: Iterable[str], step: int, objects: list[str]) -> tuple[str, ...]:
    """The first mode; more than one named is refused (the program's own state is re-run once)."""
    modes = tuple(modes)
    if len(modes) > 1:
        raise UsageError(f"step {step} takes {', '.join(objects[:3])}, the program's own object, new since an earlier "
                         f"step: re-run one mode at a time (--mode {modes[0]})")
    return modes


def unrecorded_arguments(rf: RankFile, first: int, last: int) -> list[str]:
    """The arguments of steps ``first``..``last`` recorded by class name only (an object with
    behaviour, a cache object): ``["cache (DynamicCache)"]``."""
    from replay.rerun.relaunch import recorded_args

    found: dict[str, str] = {}
    for s in range(first, last + 1):
        try:
            args = recorded_args(rf, s)
        except Exception:  # noqa: BLE001 - a step the rank did not record (another stream's)
            continue
        for name, v in args.items():
            if isinstance(v, dict) and isinstance(v.get("unrecorded"), str):
                found.setdefault(str(name), f"{name} ({a_or_an(v['unrecorded'])})")
    return list(found.values())


def check_graph_mode(rf: RankFile, modes: Iterable[str], device: str) -> None:
    """Refuse cudagraph mode off CUDA before the program is re-launched, when the rank never ran
    a step under a graph runner of its own (the only kind of cudagraph run a CPU can do): the
    re-launched program would refuse it after seconds of start-up."""
    if "cudagraph" not in modes or device.startswith("cuda"):
        return
    if not (rf.tables.steps["mode"] == RunMode.GRAPH).any():
        raise UsageError(f"cudagraph mode needs --device cuda: rank {rf.rank} ran no step under a graph runner of its "
                         "own, and a CUDA graph cannot be captured on the CPU; re-run with --mode eager")
