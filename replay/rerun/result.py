"""The result of re-running one step: one typed model for ``replay step``, its saved results,
the re-launched program's answer to its parent, and the bisections that re-run steps.

``StepRerun.to_json()`` is what is saved (``results/*.json``, with ``format``:
``RESULTS_FORMAT_VERSION``) and printed by ``--json``; ``StepRerun.from_json`` reads it back (a
re-launched program hands its result to ``replay step`` this way), so every consumer renders and
judges the same object. The outputs' tensors are not in the JSON: a result read back has their
digests only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from replay.analysis.compare import Comparison, Verdict
from replay.errors import RecordingDamaged
from replay.states import RESULTS_FORMAT_VERSION, ResultKind

__all__ = ["ModeRun", "StepDeparture", "StepRerun", "WeightCheck", "comparison_from_json"]


def comparison_from_json(d: dict[str, Any]) -> Comparison:
    """A ``Comparison`` from its ``to_json()`` (unknown keys kept in ``extra``)."""
    known = ("a", "b", "verdict", "max_abs", "max_rel", "ulp", "argmax_agree", "topk_overlap", "margin", "mismatched", "numel", "note",
             "rtol", "atol")
    try:
        verdict = Verdict(d["verdict"])
    except (KeyError, ValueError):
        raise RecordingDamaged(f"a step result holds a comparison without a known verdict ({d.get('verdict')!r})") from None
    return Comparison(str(d.get("a", "")), str(d.get("b", "")), verdict,
                      **{k: d.get(k) for k in known[3:-3]}, note=str(d.get("note") or ""),
                      rtol=_float_or_none(d.get("rtol")), atol=_float_or_none(d.get("atol")),
                      extra={k: v for k, v in d.items() if k not in known and k != "output"})


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# The departure field of a step that raised in the re-run where it completed when recorded.
RAISED_FIELD = "error"
# A departure's field where the step completed in the re-run but raised when recorded.
COMPLETED_FIELD = "status (completed; it raised when recorded)"


@dataclass(slots=True)
class StepDeparture:
    step: int
    field: str  # the first output that left the recording, or RAISED_FIELD

    def __str__(self) -> str:
        return f"step {self.step} ({self.field})"


@dataclass(kw_only=True, slots=True)
class WeightCheck:
    """The rebuilt target's parameters against the digests of the weights that ran."""

    checked: int
    differ: list[str] = field(default_factory=list)  # same name, other bits (or shape, dtype)
    missing: list[str] = field(default_factory=list)  # recorded, not in the rebuilt module
    extra: list[str] = field(default_factory=list)  # in the rebuilt module, not recorded

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WeightCheck":
        return cls(checked=int(d.get("checked") or 0), differ=list(d.get("differ") or []),
                   missing=list(d.get("missing") or []), extra=list(d.get("extra") or []))

    @property
    def same(self) -> bool:
        return not (self.differ or self.missing or self.extra)

    def to_json(self) -> dict[str, Any]:
        return {"checked": self.checked, "same": self.same, "differ": self.differ, "missing": self.missing, "extra": self.extra}

    def __str__(self) -> str:
        if self.same:
            # Digested once, at the rank's first step: a program that changes its weights later
            # (a hot swap, an in-place update) is not seen here, so say what was checked.
            return (f"weights: all {self.checked} parameters have the digests recorded at the rank's first step "
                    "(weights are digested once: a change the program made to them later is not checked)")
        parts = []
        for what, names in (("differ", self.differ), ("are not in the rebuilt model", self.missing),
                            ("were not recorded", self.extra)):
            if names:
                parts.append(f"{len(names)} {what} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
        return "weights: the rebuilt weights are not the weights that ran: " + "; ".join(parts)


@dataclass(slots=True)
class ModeRun:
    mode: str
    outputs: dict[str, torch.Tensor]  # the step's outputs (first run), on the CPU
    digests: dict[str, int]
    repeats_equal: bool | None = None  # None: run once
    repeat_digests: list[dict[str, int]] = field(default_factory=list)
    departed: StepDeparture | None = None  # first fast-forward step that left the recording
    uncompared: list[int] = field(default_factory=list)  # catch-up steps with no recorded output to compare
    caught_up: list[int] = field(default_factory=list)  # the catch-up steps run, keyframe to step
    collective_mismatches: list[str] = field(default_factory=list)
    # The step's first collective whose input left the recording ("collective #1 (all_reduce)
    # input", as a departure's field): the rank's own
    # computation departed before it, even when the outputs match (the collective's recorded
    # result was handed back). Such a mode does not reproduce the step.
    collective_departure: str | None = None
    vs_recording: dict[str, Comparison] = field(default_factory=dict)
    matches_ranks: dict[str, list[int]] = field(default_factory=dict)  # output -> ranks whose bits it has
    graph: str = ""
    ran_as: str = ""  # how the step callable ran (the Python function, or compiled again, and how)
    context_recorded: bool = False  # the recording holds the step's numerics context (restored)
    context_differences: list[str] = field(default_factory=list)  # ... and how the re-run's differed
    seconds: float = 0.0
    error: str | None = None  # the step raised in the re-run
    recorded_error: str | None = None  # the step raised when recorded

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "error": self.error,
            "recorded_error": self.recorded_error,
            "digests": {k: f"{v:016x}" for k, v in self.digests.items()},
            "repeats_equal": self.repeats_equal,
            "repeat_digests": [{k: f"{v:016x}" for k, v in d.items()} for d in self.repeat_digests],
            "departed": {"step": self.departed.step, "field": self.departed.field} if self.departed else None,
            "uncompared": self.uncompared,
            "caught_up": self.caught_up,
            "collective_mismatches": self.collective_mismatches,
            "collective_departure": self.collective_departure,
            "vs_recording": {k: c.to_json() for k, c in self.vs_recording.items()},
            "matches_ranks": self.matches_ranks,
            "graph": self.graph,
            "ran_as": self.ran_as,
            "numerics": {"recorded": self.context_recorded, "differences": self.context_differences},
            "seconds": self.seconds,
        }

    def reproduces(self) -> bool:
        """Every output bitwise equal to the recording, and every collective's input too (and it
        did not complete where it raised when recorded)."""
        return (all(c.equal for c in self.vs_recording.values()) and self.collective_departure is None
                and not self.completed_where_it_raised)

    @property
    def completed_where_it_raised(self) -> bool:
        """The step raised when recorded and completed in the re-run: it did not follow the recording."""
        return self.error is None and self.recorded_error is not None

    def difference(self) -> str:
        """How a mode that does not reproduce the step left the recording, in a clause."""
        bad = [(k, c) for k, c in self.vs_recording.items() if not c.equal]
        if self.completed_where_it_raised:
            return (f"it completed in the re-run, but raised {self.recorded_error} when recorded (what it read differs "
                    f"from what it read then: state the keyframe does not hold, a module global, a counter)")
        if not bad:
            return (f"the {self.collective_departure} differs from the recorded one: the rank's own computation departed "
                    f"before it (its outputs equal the recording's only because a one-rank re-run hands each collective its "
                    f"recorded result)")
        name, c = bad[0]
        line = f"{name} is {c.verdict_text} from the recording" + (f" (and {len(bad) - 1} more output(s))" if len(bad) > 1 else "")
        return line + (f"; before it, the {self.collective_departure} differs" if self.collective_departure else "")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModeRun":
        """A mode's run read back: its digests and verdicts (no output tensors)."""
        dep = d.get("departed")
        ctx = d.get("numerics") or {}
        return cls(
            mode=str(d["mode"]), outputs={}, digests={k: int(v, 16) for k, v in (d.get("digests") or {}).items()},
            repeats_equal=d.get("repeats_equal"),
            repeat_digests=[{k: int(v, 16) for k, v in r.items()} for r in d.get("repeat_digests") or [] if isinstance(r, dict)],
            departed=StepDeparture(int(dep["step"]), str(dep["field"])) if dep else None,
            uncompared=list(d.get("uncompared") or []), caught_up=list(d.get("caught_up") or []),
            collective_mismatches=list(d.get("collective_mismatches") or []),
            collective_departure=d.get("collective_departure") or None,
            vs_recording={k: comparison_from_json(v) for k, v in (d.get("vs_recording") or {}).items()},
            matches_ranks=dict(d.get("matches_ranks") or {}), graph=str(d.get("graph") or ""), ran_as=str(d.get("ran_as") or ""),
            context_recorded=bool(ctx.get("recorded")), context_differences=list(ctx.get("differences") or []),
            seconds=float(d.get("seconds") or 0.0), error=d.get("error"), recorded_error=d.get("recorded_error"))


NO_KEYFRAME_NOTE = "the recording holds no state keyframe: steps were re-run from a fresh target"
# Said instead of "a keyframe every step": with no keyframe at all, more keyframes hold nothing.
NO_STATE_HINT = ("the recording holds no state keyframe (replay found no tensors of the step's object to keep: a cache in "
                 "a Python list or on a plain object): name them with replay record --state NAME (a method or attribute "
                 "returning them), so that each step can start from the state it ran from")
# Said instead of either where the model's parameters changed after its first recorded step.
PARAMETERS_CHANGED_HINT = ("the step's model changed its parameters after its first recorded step (replay info names "
                           "them): a re-run builds it as it was then, so no keyframe brings the later steps back; re-run "
                           "steps before the change, or record the run from where the model is as it stays")


@dataclass(slots=True)
class StepRerun:
    recording: str
    part: str
    rank: int
    step: int
    keyframe: int
    device: str
    factory: str | None
    modes: dict[str, ModeRun]
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stream: str | None = None  # the model of the part that was rebuilt (several in one loop)
    weights: WeightCheck | None = None  # the rebuilt weights against the recorded digests
    # Arguments of the step recorded by class name only ("cache (DynamicCache)"): an object with
    # behaviour (a cache object) whose contents the re-run could not set back.
    unrecorded: list[str] = field(default_factory=list)
    # The re-run started from the re-launched program's own state at step ``keyframe`` (the
    # program ran the steps before it itself), not from a restored keyframe.
    live_start: bool = False
    # Environment variables the re-launched program got otherwise than the recorded one
    # ("LORA (not set here)"): a program that reads them computes something else.
    env_differences: list[str] = field(default_factory=list)
    # The step's object when it is not a model and the step took no recorded tensor argument:
    # what the step computes from is that object's Python state, which no keyframe holds.
    state_outside: str = ""
    # The mode the step ran in when recorded (compiled, cudagraph: a graph replay, or eager):
    # a verdict leads with it, since a mode it did not run in may round otherwise by design.
    recorded_mode: str = ""
    # The program's function that called the step (recorded at its stream's first step).
    caller: str = ""
    # The program's function that runs the loop around the step (not offered as the step).
    loop: str = ""
    # The program's source files (the script, the step's module) changed since the recording.
    sources_changed: list[str] = field(default_factory=list)
    # The model's parameters changed in names or shapes after its first recorded step ("2 added
    # (l2.lora_A, l2.lora_B)"): a re-run builds it as it was then, which no keyframe changes.
    parameters_changed: str = ""

    def problem(self) -> str | None:
        """Why step ``step`` could not be re-run or checked against the recording; None if it was.

        The CLI exits with RerunError's code when this is not None: a step that raised, or one
        whose outputs had nothing recorded to compare with, is never reported as reproduced."""
        for m in self.modes.values():
            if m.error is not None:
                kind = m.error.split(":")[0]
                if m.recorded_error is None:
                    return f"{m.mode}: step {self.step} raised {m.error} in the re-run (it completed when recorded)"
                if kind != m.recorded_error.split(":")[0]:
                    return f"{m.mode}: step {self.step} raised {m.error} in the re-run; when recorded it raised {m.recorded_error}"
                if not m.vs_recording:
                    # Raising the same error is not a comparison: nothing the step computed was checked.
                    return (f"{m.mode}: step {self.step} raised {kind} in the re-run, as it did when recorded; nothing it "
                            f"computed before raising was recorded to compare with")
            elif not m.vs_recording and not m.completed_where_it_raised:
                names = ", ".join(sorted(m.digests or m.outputs))
                why = (f"the re-run returned {names}; the recording has no output of those names" if names else
                       "the step returned no tensor the recorder could record, when recorded or re-run")
                return f"{m.mode}: no output of step {self.step} could be compared with the recording ({why})"
        return None

    def raised(self) -> str | None:
        """The error the re-run raised as the step did when recorded (what it computed before
        raising compared equal, else ``problem`` says so): reported, and never an exit 0."""
        kinds = self._raised_kinds()
        if not kinds:
            return None
        return f"rank {self.rank} step {self.step} raised {', '.join(kinds)} in the re-run, as it did when recorded"

    def _raised_kinds(self) -> list[str]:
        return sorted({m.error.split(":")[0] for m in self.modes.values() if m.error})

    def exit_reason(self) -> str | None:
        """Why ``replay step`` exits non-zero for this result (None: it reproduced, and nothing raised)."""
        return self.problem() or self.raised() or self._completed_where_raised()

    def _completed_where_raised(self) -> str | None:
        """A step that raised when recorded and completed in the re-run: not reproduced, and no
        output of it was recorded to compare (a script must not read that as a compared step)."""
        m = next((m for m in self.modes.values() if m.completed_where_it_raised and not m.vs_recording), None)
        if m is None:
            return None
        return (f"{m.mode}: step {self.step} completed in the re-run but raised {m.recorded_error} when recorded: no output "
                "of it was recorded to compare")

    def headline(self) -> str:
        """The verdict in one line, for the first line of ``replay step``: reproduced only when every
        mode's outputs were compared with the recording and every one is bitwise equal."""
        where = f"rank {self.rank} step {self.step}"
        problem = self.problem()
        if problem is not None:
            return f"not compared: {where}: {problem}"
        same = [m.mode for m in self.modes.values() if m.reproduces()]
        differ = [m for m in self.modes.values() if m.mode not in same]
        if not differ:
            return self._reproduced(where, same)
        if self.recorded_mode in same:
            # The step reproduced in the mode it ran in; the modes it did not run in are findings
            # about them (inductor's kernels, a graph's), not a failure to reproduce it.
            return self._reproduced(where, same) + self._others_differ(differ)
        first = differ[0]
        line = f"not reproduced: {where} in {first.mode}: {first.difference()}"
        if len(differ) > 1:
            line += f"; also in {', '.join(m.mode for m in differ[1:])}"
        if same:
            line += f"; {', '.join(same)} reproduce{'s' if len(same) == 1 else ''} it bit for bit"
        return line + "".join(self._caveats())

    def _others_differ(self, differ: list[ModeRun]) -> str:
        parts = [f"in {m.mode} {m.difference()}" for m in differ]
        return f"; it differs from the recording in the mode{'s' if len(differ) > 1 else ''} it did not run in: {'; '.join(parts)}"

    @property
    def no_keyframes(self) -> bool:
        """The recording holds no state keyframe (the re-run started from a fresh target)."""
        return NO_KEYFRAME_NOTE in self.notes

    def _caught_up_cleanly(self) -> bool:
        """Caught up from an earlier keyframe, every catch-up step compared and bit for bit, with
        nothing else to blame (an unrecorded argument, state outside the model, the environment)."""
        return (self.keyframe < self.step and not self.live_start and bool(self.modes)
                and all(m.caught_up and m.departed is None and not m.uncompared for m in self.modes.values())
                and not (self.unrecorded or self.state_outside or self.env_differences or self.sources_changed
                         or self.parameters_changed or (self.weights is not None and self.weights.differ)))

    def _caveats(self) -> list[str]:
        """Why a not-reproduced step may not be the program's doing: the re-run differed from the
        recorded run in its environment, its weights or an unrecorded argument."""
        varied = [m.mode for m in self.modes.values() if m.repeats_equal is False]
        # The re-run's own evidence comes first: the step computed otherwise from one run to the
        # next from the same state, which no keyframe changes (the keyframe hints are left out).
        out = [f"; but repeated runs of the step gave different bits ({', '.join(varied)}): the step itself computes "
               "otherwise from run to run from the same state and inputs (an unseeded random source, a "
               "nondeterministic kernel), which no keyframe restores"] if varied else []
        out += self._program_changed() + self._ran_otherwise()
        if not varied:
            out += self._state_hints()
        if self.unrecorded:
            # Not evidence against the program: the re-run may have run with other contents.
            out.append(f"; but the step's argument {', '.join(self.unrecorded[:3])} was not recorded, and the re-run "
                       "used the program's own object, brought to this step by re-running the steps before it: the "
                       "difference may be that object's contents, not the program (see 'Objects a step takes' in "
                       "docs/your-engine.md)")
        return out

    def _ran_otherwise(self) -> list[str]:
        """The re-run's environment, weights or inputs were not the recorded run's."""
        out = []
        if self.env_differences:
            out.append(f"; but the re-run's environment differs from the recorded one in "
                       f"{', '.join(self.env_differences[:3])}{', ...' if len(self.env_differences) > 3 else ''}: set "
                       "them as they were if the program reads them")
        if self.weights is not None and self.weights.differ:
            # The re-run's model is not the one that ran (weights swapped in for the call, a
            # ``functional_call`` with other parameters, another checkpoint): say so first.
            out.append(f"; but the step ran with other weights than the re-run's ({len(self.weights.differ)} differ: "
                       f"{', '.join(self.weights.differ[:3])}{', ...' if len(self.weights.differ) > 3 else ''}): the "
                       "difference may be theirs, not the program's")
        if self.state_outside:
            out.append(f"; but the step took no tensor argument: it computes from its {self.state_outside} object's "
                       "Python state (a scheduler's requests, lists, dicts), which no keyframe holds and a re-run cannot "
                       "set back; record the model's forward instead (no flags find it), whose inputs are recorded "
                       "every step")
        return out

    def _state_hints(self) -> list[str]:
        """Where the state the step started from is the likeliest cause (not said when repeated
        runs varied: that evidence points at the step itself)."""
        out = []
        if self.caller and self.keyframe == self.step and not self.live_start and not (
                self.env_differences or self.state_outside or self.unrecorded or self.sources_changed
                or (self.weights is not None and self.weights.differ)):
            # From its own keyframe, with its recorded inputs and RNG: what the step read
            # otherwise came from outside its arguments and its model's state.
            out.append(f"; but the step ran from its own keyframe with its recorded inputs: if it reads what its caller "
                       f"sets up outside its arguments (a global forward context, block tables, slot mappings), record "
                       f"the caller as the step: replay record --step {self.caller} -- ...")
        if self._caught_up_cleanly():
            # Every step from the keyframe re-ran bit for bit, then this one did not: what the
            # program does between steps (outside the step) is the likeliest cause.
            out.append(f"; but the steps from the keyframe at step {self.keyframe} re-ran bit for bit: {self._between_steps_hint()}")
        return out

    def _program_changed(self) -> list[str]:
        """The caveats of a program that is not the one recorded: its source, its model's parameters."""
        out = []
        if self.sources_changed:
            out.append(f"; but the program's source changed since it was recorded ({', '.join(self.sources_changed[:3])}"
                       f"{', ...' if len(self.sources_changed) > 3 else ''}): the re-run runs the code as it is now")
        if self.parameters_changed:
            out.append(f"; but the step's model changed its parameters after its first recorded step "
                       f"({self.parameters_changed}): the re-run builds it as it was then, which no keyframe changes")
        return out

    def _between_steps_hint(self) -> str:
        if self.parameters_changed:
            return PARAMETERS_CHANGED_HINT
        if self.no_keyframes:
            return NO_STATE_HINT
        return ("if the program changes the model's state between steps (a beam search reordering its cache, a reset "
                "after an error), a keyframe every step restores it: replay record --keyframe-every 1")

    def _reproduced(self, where: str, same: list[str]) -> str:
        n = len({k for m in self.modes.values() for k in m.vs_recording})
        each = " in each mode" if len(same) > 1 else ""
        raised = self._raised_kinds()
        also = f"; it raised {', '.join(raised)} as it did when recorded" if raised else ""
        as_recorded = f", the mode it ran in when recorded" if len(same) == 1 and same[0] == self.recorded_mode and \
            len(self.modes) > 1 else ""
        return (f"reproduced: {where} re-ran bit for bit in {', '.join(same)}{as_recorded} ({n} output(s) bitwise equal to "
                f"the recording{each}){also}{self._catch_up_caveat(same)}")

    def _catch_up_caveat(self, same: list[str]) -> str:
        """The step matched, but a catch-up step before it did not: said in the verdict line, not
        left to the body, since the state the step ran from was not the recorded one."""
        off = [m for m in self.modes.values() if m.departed is not None and m.mode in same]
        if not off:
            return ""
        first = min((m.departed for m in off if m.departed is not None), key=lambda d: d.step)
        return (f"; but catch-up {first} departed from the recording in {', '.join(m.mode for m in off)}: the steps "
                f"before it did not all re-run as recorded")

    def to_json(self) -> dict[str, Any]:
        verdicts = [c.to_json() for c in self.comparisons]
        for m in self.modes.values():
            verdicts += [dict(c.to_json(), output=k) for k, c in m.vs_recording.items()]
        return {
            "kind": str(ResultKind.STEP),
            "format": RESULTS_FORMAT_VERSION,
            "recording": self.recording,
            "part": self.part,
            "rank": self.rank,
            "step": self.step,
            "keyframe": self.keyframe,
            "device": self.device,
            "factory": self.factory,
            "modes": {k: m.to_json() for k, m in self.modes.items()},
            "verdicts": verdicts,
            "notes": self.notes,
            "stream": self.stream,
            "weights": self.weights.to_json() if self.weights is not None else None,
            "unrecorded_arguments": self.unrecorded,
            "live_start": self.live_start,
            "env_differences": self.env_differences,
            "state_outside": self.state_outside or None,
            "recorded_mode": self.recorded_mode or None,
            "caller": self.caller or None,
            "loop": self.loop or None,
            "sources_changed": self.sources_changed,
            "parameters_changed": self.parameters_changed or None,
            "problem": self.problem(),
            "raised": self.raised(),
            "headline": self.headline(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepRerun":
        """Read a step result back (a saved one, or a re-launched program's); one of a newer
        format is refused rather than misread."""
        version = d.get("format", RESULTS_FORMAT_VERSION)
        if d.get("kind") != ResultKind.STEP or not isinstance(version, int) or version > RESULTS_FORMAT_VERSION:
            raise RecordingDamaged(f"not a step result this replay can read (kind {d.get('kind')!r}, format {version!r})")
        modes = {k: ModeRun.from_json(m) for k, m in (d.get("modes") or {}).items()}
        across = [comparison_from_json(v) for v in d.get("verdicts") or [] if "output" not in v]
        text = {k: str(d.get(k) or "") for k in ("recording", "part", "device", "state_outside", "recorded_mode", "caller",
                                                 "loop", "parameters_changed")}
        return cls(recording=text["recording"], part=text["part"], rank=int(d["rank"]),
                   step=int(d["step"]), keyframe=int(d.get("keyframe") or 0), device=text["device"],
                   factory=d.get("factory"), modes=modes, comparisons=across, notes=list(d.get("notes") or []),
                   stream=d.get("stream"), weights=WeightCheck.from_json(d["weights"]) if d.get("weights") else None,
                   unrecorded=[str(u) for u in d.get("unrecorded_arguments") or []], live_start=d.get("live_start") is True,
                   env_differences=[str(e) for e in d.get("env_differences") or []],
                   state_outside=text["state_outside"], recorded_mode=text["recorded_mode"], caller=text["caller"], loop=text["loop"],
                   sources_changed=[str(s) for s in d.get("sources_changed") or []],
                   parameters_changed=text["parameters_changed"])


