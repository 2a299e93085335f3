"""Re-run one recorded step of one rank: restore, fast-forward from the keyframe, run, compare.

1. Rebuild the target from its factory, capture its graphs (cudagraph mode), restore the nearest
   state keyframe at or before the step.
2. Feed the recorded inputs of the steps in between, teacher-forced, with each step's recorded
   RNG state and collectives; compare each step's outputs with the recording and note the first
   step where the re-run departs from it.
3. Run the step itself (``repeat`` times, from the same state, to tell nondeterministic kernels
   from a deterministic difference) in each requested mode, and compare it with the recording,
   with the other ranks' recordings, and across modes.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from replay.analysis.compare import Comparison, Verdict, compare_digests, compare_tensors
from replay.digest import digest
from replay.errors import OutOfRange, RerunError, UsageError
from replay.format.reader import Part, RankFile
from replay.format.schema import TensorKind
from replay.record.rng import restore_rng
from replay.record.session import name_outputs
from replay.rerun.collectives import RecordedCollectives
from replay.rerun.graphs import GraphedStep
from replay.rerun.target import Target, TargetSpec, build_target

__all__ = ["MODES", "ModeRun", "StepRerun", "rerun_step", "StepDeparture"]

MODES = ("eager", "cudagraph")


@dataclass(slots=True)
class StepDeparture:
    step: int
    field: str

    def __str__(self) -> str:
        return f"step {self.step} ({self.field})"


@dataclass(slots=True)
class ModeRun:
    mode: str
    outputs: dict[str, torch.Tensor]  # the step's outputs (first run), on the CPU
    digests: dict[str, int]
    repeats_equal: bool | None = None  # None: run once
    repeat_digests: list[dict[str, int]] = field(default_factory=list)
    departed: StepDeparture | None = None  # first fast-forward step that left the recording
    collective_mismatches: list[str] = field(default_factory=list)
    vs_recording: dict[str, Comparison] = field(default_factory=dict)
    matches_ranks: dict[str, list[int]] = field(default_factory=dict)  # output -> ranks whose bits it has
    graph: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "digests": {k: f"{v:016x}" for k, v in self.digests.items()},
            "repeats_equal": self.repeats_equal,
            "departed": {"step": self.departed.step, "field": self.departed.field} if self.departed else None,
            "collective_mismatches": self.collective_mismatches,
            "vs_recording": {k: c.to_json() for k, c in self.vs_recording.items()},
            "matches_ranks": self.matches_ranks,
            "graph": self.graph,
            "seconds": self.seconds,
        }


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

    def to_json(self) -> dict[str, Any]:
        verdicts = [c.to_json() for c in self.comparisons]
        for m in self.modes.values():
            verdicts += [dict(c.to_json(), output=k) for k, c in m.vs_recording.items()]
        return {
            "kind": "step",
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
        }


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.to(device) if device != "cpu" else t


def _step_args(rf: RankFile, step: int) -> dict[str, Any]:
    row = rf.step(step).row
    sid = int(row["args"])
    if sid < 0:
        return {}
    try:
        args = json.loads(rf.tables.string(sid))
    except ValueError:
        return {}
    bad = [k for k, v in args.items() if isinstance(v, dict)]
    if bad:
        raise RerunError(f"step {step} was called with arguments that cannot be recorded ({', '.join(bad)}): it cannot be re-run")
    return args


def _recorded_fields(rf: RankFile, step: int) -> dict[str, int]:
    return dict(rf.step(step).fields())


class _StepDriver:
    """Calls the target's step with one recorded step's inputs, RNG state and collectives."""

    def __init__(self, rf: RankFile, target: Target, device: str, collectives: RecordedCollectives | None,
                 outputs_names: list[str], graphed: GraphedStep | None) -> None:
        self.rf = rf
        self.target = target
        self.device = device
        self.collectives = collectives
        self.outputs_names = outputs_names
        self.graphed = graphed

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        view = self.rf.step(step)
        inputs = {k: _to_device(v, self.device) for k, v in view.inputs.items()}
        args = _step_args(self.rf, step)
        rng = view.tensors(TensorKind.RNG)
        if rng:
            restore_rng(rng)
        if self.collectives is not None:
            self.collectives.begin_step(step)
        fn = self.graphed if self.graphed is not None else self.target.step_fn
        out = fn(**_unflatten(inputs), **args)
        if self.collectives is not None:
            self.collectives.end_step()
        outs = name_outputs(out, tuple(self.outputs_names))
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return {k: v.detach().to("cpu", copy=True) for k, v in outs.items()}


def _unflatten(inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of the recorder's flattening of list/dict arguments (``name.0``, ``name.key``)."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in inputs.items():
        if "." in k:
            base, _, sub = k.partition(".")
            groups.setdefault(base, {})[sub] = v
        else:
            out[k] = v
    for base, items in groups.items():
        if all(s.isdigit() for s in items):
            out[base] = [items[s] for s in sorted(items, key=int)]
        else:
            out[base] = items
    return out


def _departure(outs: dict[str, torch.Tensor], recorded: dict[str, int]) -> str | None:
    for name, t in outs.items():
        for prefix in ("output.", "tokens."):
            rec = recorded.get(prefix + name)
            if rec is not None and digest(t) != rec:
                return prefix + name
    return None


def _ranks_with(part: Part, step: int, fieldname: str, value: int) -> list[int]:
    out = []
    for r, rf in part.items():
        try:
            if _recorded_fields(rf, step).get(fieldname) == value:
                out.append(r)
        except OutOfRange:
            continue
    return out


def _ring_logits(rf: RankFile, step: int) -> torch.Tensor | None:
    t = rf.full()
    rows = t.tensors[(t.tensors["kind"] == TensorKind.LOGITS) & (t.tensors["step"] == step)]
    return rf.read_tensor(rows[-1]) if rows.size else None


def rerun_step(
    part: Part,
    rank: int,
    step: int,
    *,
    modes: Iterable[str] = ("eager",),
    device: str = "cpu",
    repeat: int = 1,
    factory: str | None = None,
    options: dict[str, Any] | None = None,
    recording: str = "",
    announce: Callable[[str], None] = lambda s: None,
    progress: Callable[..., Iterable[int]] = lambda it, label="": it,
    live_collectives: bool = False,
    keyframe_at: int | None = None,
) -> StepRerun:
    """Re-run ``step`` of ``rank`` in each of ``modes``; see the module docstring."""
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r}: use eager, cudagraph or both")
    if repeat < 1:
        raise UsageError("--repeat must be at least 1")
    rf = part[rank]
    rf.step(step)  # range check with a clear message
    spec = TargetSpec.from_rank_file(rf)
    kf = rf.keyframe(step if keyframe_at is None else min(keyframe_at, step))
    if kf is None:
        if spec.state is not None:
            raise RerunError(f"rank {rank} has no state keyframe at or before step {step}")
        kf_step, kf_state = 0, {}
    else:
        kf_step, kf_state = kf
    world = part.world_size
    fac = factory or spec.factory
    result = StepRerun(recording=recording, part=part.name, rank=rank, step=step, keyframe=kf_step, device=device, factory=fac, modes={})
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device here; use --device cpu")
    if fac is not None:
        announce(f"importing factory {fac}" + (" (named by the recording)" if factory is None else " (--factory)"))
    tuner = rf.tuner_choices()
    for mode in modes:
        t0 = time.perf_counter()
        opts = dict(options or {})
        opts.setdefault("cudagraph", mode == "cudagraph")
        if tuner:
            opts.setdefault("tuner_choices", {k: v for k, v in tuner.items() if not k.startswith("triton:")})
        target = build_target(spec, rank=rank, world_size=world, device=device, options=opts, factory=factory)
        own_graphs = "cudagraph" in target.toggles()
        graphed = None
        if mode == "cudagraph" and not own_graphs:
            if not device.startswith("cuda"):
                raise UsageError("cudagraph mode for a target without its own graph runner needs --device cuda")
            graphed = GraphedStep(target)
        coll = None if (world == 1 or live_collectives) else RecordedCollectives(rf, rank, world)
        ctx = coll.installed() if coll is not None else contextlib.nullcontext()
        with ctx:
            if mode == "cudagraph":
                target.prepare()
            if kf_state:
                target.load_state(kf_state)
            driver = _StepDriver(rf, target, device, coll, spec.outputs, graphed)
            departed = None
            for s in progress(range(kf_step, step), label=f"rank {rank} {mode}: steps {kf_step}..{step - 1}"):
                outs = driver(s)
                bad = _departure(outs, _recorded_fields(rf, s))
                if bad and departed is None:
                    departed = StepDeparture(s, bad)
            saved = target.snapshot() if repeat > 1 else None
            outs = driver(step)
            run = ModeRun(mode=mode, outputs=outs, digests={k: digest(v) for k, v in outs.items()}, departed=departed)
            info = getattr(target.obj, "last_run_info", None)
            if isinstance(info, dict):
                run.graph = f"{info.get('mode', '')} {info.get('key', '')}".strip() + (f" ({info['reason']})" if info.get("reason") else "")
            for _ in range(repeat - 1):
                assert saved is not None
                target.load_state(saved)
                again = driver(step)
                run.repeat_digests.append({k: digest(v) for k, v in again.items()})
            if repeat > 1:
                run.repeats_equal = all(d == run.digests for d in run.repeat_digests)
        if coll is not None:
            run.collective_mismatches = [str(m) for m in coll.mismatches]
        recorded = _recorded_fields(rf, step)
        ring = _ring_logits(rf, step)
        for name, t in outs.items():
            key = next((p + name for p in ("output.", "tokens.") if p + name in recorded), None)
            if key is None:
                continue
            if name == "logits" and ring is not None and ring.shape == t.shape:
                run.vs_recording[name] = compare_tensors(t, ring, name_a=f"{mode} re-run", name_b=f"rank {rank} recorded")
            else:
                run.vs_recording[name] = compare_digests(run.digests[name], recorded[key], name_a=f"{mode} re-run", name_b=f"rank {rank} recorded")
            run.matches_ranks[name] = _ranks_with(part, step, key, run.digests[name])
        run.seconds = time.perf_counter() - t0
        result.modes[mode] = run
        del target
    if len(modes) == 2:
        a, b = (result.modes[m] for m in modes)
        for name in a.outputs.keys() & b.outputs.keys():
            result.comparisons.append(compare_tensors(a.outputs[name], b.outputs[name], name_a=f"eager {name}", name_b=f"cudagraph {name}"))
    # Against the other ranks' logits, where their ring kept this step.
    first = result.modes[modes[0]]
    if "logits" in first.outputs:
        for r, other in part.items():
            if r == rank:
                continue
            lg = _ring_logits(other, step)
            if lg is not None and lg.shape == first.outputs["logits"].shape:
                result.comparisons.append(compare_tensors(first.outputs["logits"], lg, name_a=f"{modes[0]} re-run", name_b=f"rank {r} recorded"))
    if spec.state is None:
        result.notes.append("the target declares no state: steps were re-run from a fresh target")
    return result


def verdict_matches(c: Comparison) -> bool:
    return c.verdict is Verdict.BITWISE_EQUAL
