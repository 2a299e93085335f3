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

import asyncio
import contextlib
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from replay.textsafe import a_or_an
from replay.analysis.compare import Comparison, Verdict, compare_digests, compare_tensors
from replay.digest import digest, local_tensor
from replay.errors import CatchUpRaised, OutOfRange, RecordingDamaged, RerunError, UsageError
from replay.format.reader import Part, RankFile
from replay.format.schema import TensorKind
from replay.core.outputs import name_outputs
from replay.core.rng import restore_rng
from replay.core.structure import POSITIONAL_ARG, STRUCTURE_ARG, RecordedDict, RecordedObject, call_arguments, rebuild_inputs, unrecordable
from replay.core.weights import describe_parameter_changes, weight_digests
from replay.rerun.result import NO_KEYFRAME_NOTE
from replay.rerun.collectives import RecordedCollectives
from replay import numerics
from replay.numerics import strip_reserved
from replay.rerun.graphs import GraphedStep
from replay.rerun.imports import import_context
from replay.rerun.streams import check_stream, stream_of, stream_state
from replay.rerun.target import StepKind, Target, TargetSpec, build_target

from replay.core.state import held_module
from replay.rerun.result import COMPLETED_FIELD, RAISED_FIELD, ModeRun, StepDeparture, StepRerun, WeightCheck

__all__ = ["MODES", "ModeRun", "Replayer", "RerunOptions", "StepRerun", "default_modes", "rerun_step", "StepDeparture", "WeightCheck"]

MODES = ("eager", "cudagraph", "compiled")


def recorded_model(target: Target) -> torch.nn.Module | None:
    """The model whose weights the recorder digested: the step's object when it is a module (its
    parameters named from there, ``lm.emb.weight``), else the one model it holds; not the
    submodule ``--modules`` names (where bisect's hooks go, whose names lack the prefix)."""
    obj = target.obj
    if isinstance(obj, torch.nn.Module):
        return obj
    held = held_module(obj) if obj is not None else None
    return held[1] if held is not None else target.module()


def check_weights(target: Target) -> WeightCheck | None:
    """Compare the rebuilt module's parameters with the recorded per-parameter digests."""
    recorded = target.spec.weights
    model = recorded_model(target)
    if not recorded or model is None:
        return None
    live = weight_digests(model)
    differ = [n for n in recorded if n in live and any(live[n].get(k) != recorded[n].get(k) for k in ("digest", "shape", "dtype"))]
    return WeightCheck(checked=len(recorded), differ=differ, missing=[n for n in recorded if n not in live],
                       extra=[n for n in live if n not in recorded])


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.to(device) if device != "cpu" else t


# Said where a step raised or departed after a catch-up: catch-up cannot redo what the program
# did to its state between steps; a keyframe at each step holds it.
KEYFRAME_EVERY_STEP_HINT = ("if the program changes its state between steps (a cache it grows or reorders, a counter), "
                            "record with --keyframe-every 1 so each step starts from its own keyframe")


def caller_hint(caller: str | None, loop: str | None = None) -> str:
    """The other remedy, where the recording knows the program's function that called the step:
    a step that reads what its caller set up outside its arguments (a global forward context
    with the batch's block tables, as vLLM-style runners keep) reproduces when the caller is
    the step, since then that set-up is part of it. A caller that runs the loop (a script's
    ``main``) is no step: what it sets between steps must reach the step otherwise."""
    if not caller and loop:
        return (f"; if the step reads what the loop in {loop} sets between steps outside its arguments (a module "
                "global, a context object), no keyframe holds it: pass it to the step as an argument, or set it in a "
                "function the loop calls and record that function as the step (--step MODULE:QUALNAME)")
    if not caller:
        return ""
    # Both remedies at once: which one applies depends on where the set-up happens, which the
    # recording cannot tell (a caller that only calls the step leaves it to the loop around it).
    return (f"; if the step reads what its caller sets up outside its arguments (a global forward context, "
            f"block tables, slot mappings), record the caller as the step: replay record --step {caller} -- ...; "
            f"if the loop that calls {caller} sets it between steps instead, no keyframe holds it: pass it to the step "
            "as an argument")


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one (before anything is built or launched)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device here; use --device cpu")


def _raw_args(rf: RankFile, step: int) -> dict[str, Any]:
    """A step's recorded JSON arguments as recorded, reserved ones (``__structure__``) included."""
    sid = int(rf.step(step).row["args"])
    if sid < 0:
        return {}
    try:
        args = json.loads(rf.tables.string(sid))
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}


def _step_inputs(rf: RankFile, step: int, device: str, flat: dict[str, Any] | None = None) -> dict[str, Any]:
    """A step's recorded tensor inputs as the step takes them: nested containers (an HF
    ``past_key_values`` tuple of tuples) rebuilt with their recorded shape. ``flat`` receives
    the same tensors by their recorded names."""
    inputs = {k: _to_device(v, device) for k, v in rf.step(step).inputs.items()}
    if flat is not None:
        flat.update(inputs)
    raw = _raw_args(rf, step)
    structures = raw.get(STRUCTURE_ARG)
    return rebuild_inputs(inputs, structures if isinstance(structures, dict) else None, raw.get(POSITIONAL_ARG))


def _live_value(live: dict[str, Any], name: str) -> tuple[bool, Any]:
    """(found, value) of a recorded argument among a re-launched program's live ones: by name,
    or an ``*args`` item (``args.2``) in the tuple the program passed."""
    if name in live:
        return True, live[name]
    base, _, index = name.rpartition(".")
    seq = live.get(base)
    if index.isdigit() and isinstance(seq, tuple) and int(index) < len(seq):
        return True, seq[int(index)]
    return False, None


class LiveObjects:
    """The re-launched program's objects a step takes that the recording holds by class name only
    (a ``DynamicCache``), as they were when the step was taken: each mode and each ``--repeat`` of
    the step starts from its own copy, since a run changes them (a cache grows by the step's
    tokens) and the next would otherwise start from what the last one left."""

    def __init__(self, rf: RankFile, step: int, live: dict[str, Any]) -> None:
        import copy

        self.kept: dict[str, Any] = {}
        self.uncopied: list[str] = []  # objects that could not be copied: shared by the runs
        for name, v in _raw_args(rf, step).items():
            if not (isinstance(v, dict) and "unrecorded" in v and name in live):
                continue
            try:
                self.kept[name] = copy.deepcopy(live[name])
            except Exception:  # noqa: BLE001 - an object that refuses a copy (a lock, a file)
                self.uncopied.append(f"{name} ({a_or_an(type(live[name]).__name__)})")

    def fresh(self, live: dict[str, Any]) -> dict[str, Any]:
        """``live`` with a new copy of each kept object."""
        import copy

        return {**live, **{k: copy.deepcopy(v) for k, v in self.kept.items()}}


def _positional(rf: RankFile, step: int) -> list[str]:
    """The recorded names of the step's arguments passed by position (``*args``), in order."""
    names = _raw_args(rf, step).get(POSITIONAL_ARG)
    return [str(n) for n in names] if isinstance(names, list) else []


class _CallAsRecorded:
    """The step callable behind ``GraphedStep`` (which passes keywords only), calling the step
    with the arguments named under ``POSITIONAL_ARG`` by position, as recorded."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, **kwargs: Any) -> Any:
        args, kwargs = call_arguments(kwargs, kwargs.pop(POSITIONAL_ARG, None))
        return self.fn(*args, **kwargs)


def _step_args(rf: RankFile, step: int, obj: Any = None, live: dict[str, Any] | None = None) -> dict[str, Any]:
    """A step's recorded JSON arguments, with the objects it was called with put back: the
    target itself, the target's attribute of the recorded name (its KV cache), or the live value
    the re-launched program passed (``live``)."""
    args = strip_reserved(_raw_args(rf, step))
    live = live or {}
    for k, v in args.items():
        if not isinstance(v, dict) or "generator" in v:
            continue  # a generator: set to its recorded state by ``_generator_args``
        if v.get("target") is True and obj is not None:
            args[k] = obj
        elif isinstance(v.get("attr"), str) and obj is not None and hasattr(obj, v["attr"]):
            args[k] = getattr(obj, v["attr"])
        elif (found := _live_value(live, k))[0]:
            args[k] = found[1]
    bad = [k for k, v in args.items() if isinstance(v, dict) and (v.get("target") is True or "attr" in v or "unrecorded" in v)]
    if bad:
        raise RerunError(f"step {step} was called with arguments that cannot be recorded ({', '.join(bad)}): it cannot be re-run")
    return args


def _written(flat: dict[str, Any], fields: dict[str, int]) -> dict[str, torch.Tensor]:
    """What a step that returned nothing wrote into its arguments, under the names the recording
    gave them (``replay.core.outputs.written_outputs``)."""
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor) and (f"output.{k}" in fields or f"tokens.{k}" in fields)}


def _generator_args(args: dict[str, Any], inputs: dict[str, Any], live: dict[str, Any], step: int,
                    flat: dict[str, Any]) -> None:
    """Generators the step was given, in their recorded state (the state is recorded as the
    argument's input, taken out of ``inputs`` and ``flat``): the program's own generator when
    re-launched, a new one otherwise."""
    for k, v in list(args.items()):
        if not (isinstance(v, dict) and isinstance(v.get("generator"), str) and isinstance(inputs.get(k), torch.Tensor)):
            continue
        state = inputs.pop(k).to("cpu")
        flat.pop(k, None)  # the state went in; it is not something the step writes
        gen = _live_value(live, k)[1]
        if not isinstance(gen, torch.Generator):
            device = torch.device(v["generator"])
            if device.type == "cuda" and not torch.cuda.is_available():
                raise RerunError(f"step {step} draws from a CUDA generator ({k}): re-run it on a machine with CUDA")
            gen = torch.Generator(device=device)
        try:
            gen.set_state(state)
        except RuntimeError as e:
            raise RerunError(f"step {step}: the recorded state of generator {k} cannot be set here ({e})") from None
        args[k] = gen


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
        self.probed: dict[str, torch.Tensor] = {}
        self.last_error: str | None = None
        # The numerics context of the last step run: how it differed from the recorded one (after
        # restoring it), and whether the recording had one at all.
        self.context_differences: list[str] = []
        self.context_recorded: bool = False

    def probe_sink(self, label: str, outputs: dict[str, Any]) -> None:
        for k, v in outputs.items():
            if isinstance(v, torch.Tensor):
                self.probed[f"{label}.{k}" if label else k] = local_tensor(v).detach().to("cpu", copy=True)

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        """Run one step; a step that raises returns what its probes saw (``last_error`` says why)."""
        self.probed = {}
        self.last_error = None
        try:
            outs = self._call(step)
        except (RerunError, UsageError, RecordingDamaged):
            raise  # the re-run's own stop, or the recording's damage: never "the step raised"
        except Exception as e:  # noqa: BLE001 - a recorded step may raise (a lockstep check): compare it
            self.last_error = f"{e.__class__.__name__}: {e}"
            outs = {}
        return {**self.probed, **outs}

    def _invoke(self, fn: Callable[..., Any], step: int, values: dict[str, Any]) -> Any:
        """Call the step with its recorded arguments as the program called it: by keyword, and
        those it passed by position (``*args``, positional-only parameters) by position."""
        positional = _positional(self.rf, step)
        if not positional:
            return fn(**values)
        if fn is self.graphed:
            return fn(**values, **{POSITIONAL_ARG: positional})  # to ``_CallAsRecorded`` behind it
        try:
            args, kwargs = call_arguments(values, positional)
        except KeyError as e:
            raise RerunError(f"step {step}: {e.args[0]}: it cannot be re-run") from None
        return fn(*args, **kwargs)

    def _call(self, step: int) -> dict[str, torch.Tensor]:
        view = self.rf.step(step)
        flat: dict[str, Any] = {}
        inputs = _step_inputs(self.rf, step, self.device, flat)
        live = self.target.live_args
        for k, v in inputs.items():
            if isinstance(v, (RecordedObject, RecordedDict)) and (found := _live_value(live, k))[0]:
                inputs[k] = v.as_instance(found[1])  # the program's own class, with the recorded fields
        args = _step_args(self.rf, step, self.target.obj, live)
        _generator_args(args, inputs, live, step, flat)
        rng = view.tensors(TensorKind.RNG)
        if rng:
            restore_rng(rng)
        if self.collectives is not None:
            self.collectives.begin_step(step)
        fn = self.graphed if self.graphed is not None else self.target.step_fn
        recorded = numerics.recorded_context(self.rf, step)
        self.context_recorded = recorded is not None
        with numerics.apply(recorded or {}) as failed:
            # Compared inside the context: what the step really ran under, setting by setting.
            self.context_differences = numerics.differences(recorded, numerics.capture()) if recorded else []
            self.context_differences += [f"{n}: could not be set here" for n in failed]
            out = self._invoke(fn, step, {**inputs, **args})
            if inspect.iscoroutine(out):
                out = _run_coroutine(out, step)
        if self.collectives is not None:
            self.collectives.end_step()
        fields = _recorded_fields(self.rf, step)
        outs = _named_outputs(out, tuple(self.outputs_names), fields) if out is not None else _written(flat, fields)
        # What the recorder could not record either (a nested or sparse output) is not compared:
        # ``step.not_compared`` names it.
        outs = {k: v for k, v in outs.items() if unrecordable(v) is None}
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return {k: local_tensor(v).detach().to("cpu", copy=True) for k, v in outs.items()}


def _run_coroutine(coro: Any, step: int) -> Any:
    """An ``async def`` step's coroutine, run to its end. Inside the program's running event
    loop (a re-launch takes the step at its call) it is stepped by hand: a step that awaits
    only bare yields (``asyncio.sleep(0)``) runs; one that waits on I/O or another task cannot."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()
    try:
        while True:
            waits_on = coro.send(None)
            if waits_on is not None:
                coro.close()
                raise RerunError(f"step {step}: the async step waits on {type(waits_on).__name__} (a timer, I/O or another "
                                 "task), which a re-run inside the program's event loop cannot wait for; record a step that "
                                 "does not await: the model's forward (no flags find it), or the function the coroutine "
                                 "calls to compute (--step MODULE:QUALNAME)")
    except StopIteration as done:
        return done.value


def _named_outputs(out: Any, names: tuple[str, ...], recorded: dict[str, int]) -> dict[str, torch.Tensor]:
    """The step's outputs named as the recording named them. A recording made before tuples'
    logits were named ``logits`` has them as ``output.out{i}``: positional names then, so that
    an older recording still re-runs instead of reporting its logits as not returned."""
    outs = name_outputs(out, names)
    if names or "logits" not in outs or not isinstance(out, (list, tuple)) or "output.logits" in recorded:
        return outs
    positional = tuple(f"out{i}" for i in range(len(out)))
    if not any(f"output.{n}" in recorded for n in positional):
        return outs
    return name_outputs(out, positional)


def _departure(outs: dict[str, torch.Tensor], recorded: dict[str, int]) -> str | None:
    return _check_outputs(outs, recorded)[0]


def _check_outputs(outs: dict[str, torch.Tensor], recorded: dict[str, int]) -> tuple[str | None, int]:
    """(first recorded field the re-run's outputs leave, how many recorded fields were compared).

    Zero compared means nothing can be said about the step: no "as recorded" without a comparison.
    """
    compared = 0
    for name, t in outs.items():
        for prefix in ("output.", "tokens."):
            rec = recorded.get(prefix + name)
            if rec is None:
                continue
            compared += 1
            if digest(t) != rec:
                return prefix + name, compared
    for key in recorded:
        prefix, _, name = key.partition(".")
        if prefix in ("output", "tokens") and name not in outs:
            return f"{key}: recorded, not returned by the re-run", compared
    return None, compared


def _ranks_with(part: Part, step: int, fieldname: str, value: int) -> list[int]:
    out = []
    for r, rf in part.items():
        try:
            if _recorded_fields(rf, step).get(fieldname) == value:
                out.append(r)
        except (OutOfRange, RecordingDamaged):
            continue  # a rank without the step, or whose file cannot be read: not one with these bits
    return out


def _ranks_with_ring_logits(part: Part, step: int, value: int) -> list[int]:
    """Ranks whose logits ring kept this step with exactly these bits (digests only, no payload)."""
    out = []
    for r, rf in part.items():
        try:
            t = rf.full().tensors
        except RecordingDamaged:
            continue  # a rank whose file cannot be read
        rows = t[(t["kind"] == TensorKind.LOGITS) & (t["step"] == step)]
        if rows.size and int(rows["digest"][-1]) == value:
            out.append(r)
    return out


def _ring_logits(rf: RankFile, step: int) -> torch.Tensor | None:
    t = rf.full()
    rows = t.tensors[(t.tensors["kind"] == TensorKind.LOGITS) & (t.tensors["step"] == step)]
    return rf.read_tensor(rows[-1]) if rows.size else None


class Replayer:
    """A target rebuilt for one rank and mode, brought to the start of a recorded step.

    The building block of ``rerun_step`` and of bisection::

        rp = Replayer(part, rank, mode="eager", device="cpu")
        rp.build(install=lambda target: ...)   # e.g. put taps on modules before graphs exist
        rp.goto(812)                           # restore the keyframe, fast-forward teacher-forced
        outs = rp.run(812)                     # outputs of step 812, on the CPU
    """

    def __init__(
        self,
        part: Part,
        rank: int,
        *,
        mode: str = "eager",
        device: str = "cpu",
        factory: str | None = None,
        options: dict[str, Any] | None = None,
        live_collectives: bool = False,
        use_recorded_tuner: bool = True,
        as_rank: int | None = None,
        make_target: Callable[["Replayer"], Target] | None = None,
        spec: TargetSpec | None = None,
        stream: str | None = None,
        step: int | None = None,
    ) -> None:
        """``as_rank``: build the target as that rank (its rank-specific settings and recorded
        tuner choices) but replay ``rank``'s recorded data (keyframes, inputs, RNG, collectives):
        bisection runs two ranks' targets on the same data, so only their settings differ."""
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}: use eager, cudagraph, compiled or both")
        check_device(device)
        self.part = part
        self.rank = rank
        self.rf = part[rank]
        # Which model of the part (stream) is rebuilt: the one named, or the one holding ``step``.
        self.stream = check_stream(self.rf, step, stream) if step is not None else stream
        self.spec = spec or TargetSpec.from_rank_file(self.rf, self.stream)
        if spec is None and as_rank is not None and as_rank != rank:
            # Built as that rank: with its own recorded config (a setting only it was given),
            # compile arguments and weights; fed this rank's data.
            own = TargetSpec.from_rank_file(part[as_rank], self.stream)
            self.spec.config, self.spec.compile, self.spec.weights = own.config, own.compile, own.weights
        self.make_target = make_target  # instead of the factory: a re-launched program's own objects
        self.mode = mode
        self.device = device
        self.factory = factory
        self.world = part.world_size
        self.live = live_collectives
        opts = dict(options or {})
        opts.setdefault("cudagraph", mode == "cudagraph")
        self.target_rank = rank if as_rank is None else as_rank
        tuner = part[self.target_rank].tuner_choices() if use_recorded_tuner else {}
        if tuner:
            opts.setdefault("tuner_choices", {k: v for k, v in tuner.items() if not k.startswith("triton:")})
        self.options = opts
        self.target: Target | None = None
        self.collectives = None if (self.world == 1 or live_collectives) else RecordedCollectives(self.rf, self.target_rank, self.world)
        if self.collectives is not None:
            self.collectives.recorded_compiled = self.spec.kind is StepKind.COMPILED
        self._driver: _StepDriver | None = None
        self._ctx: contextlib.ExitStack | None = None
        self.departed: StepDeparture | None = None
        self.position: int | None = None  # the step the target's state is at the start of
        self.last_outputs: dict[str, torch.Tensor] = {}  # outputs of the last step scan() ran
        self.keyframe: int = 0
        self.uncompared: list[int] = []  # catch-up steps with no recorded output to compare with
        self.caught_up: list[int] = []  # the catch-up steps goto() ran (its stream's only)
        self.restored_on_the_way: list[int] = []  # later keyframes goto() restored as it reached them
        self.live_start = False  # goto() started from the program's own state, restoring no keyframe

    def _compiled(self) -> str | None:
        """How torch.compile runs a function step in this mode (None: the Python function).

        ``compiled``: as recorded; ``cudagraph`` for a step recorded compiled: torch.compile's own
        CUDA graphs (reduce-overhead), as the program ran it, rather than replay's hand capture."""
        if self.mode == "compiled":
            return "recorded"
        if self.mode == "cudagraph" and self.spec.kind is StepKind.COMPILED:
            return "cudagraph"
        return None

    @property
    def factory_name(self) -> str | None:
        return self.factory or self.spec.factory

    def keyframe_for(self, step: int) -> tuple[int, dict[str, torch.Tensor]]:
        kf = self.rf.keyframe(step)
        if kf is None:
            if self.spec.state is not None:
                raise RerunError(f"rank {self.rank} has no state keyframe at or before step {step}")
            return 0, {}
        return kf

    def check(self, first: int, last: int) -> None:
        """Fail early (before importing anything) if steps first..last cannot be replayed."""
        self.rf.step(last)
        if self.collectives is not None:
            self.collectives.check_replayable(first, last)

    def build(self, install: Callable[[Target], None] | None = None) -> Target:
        """Build the target; ``install(target)`` runs before any graph is captured."""
        if self._compiled() == "cudagraph" and not self.device.startswith("cuda"):
            # torch.compile's reduce-overhead mode captures no graph off CUDA: a run called
            # "cudagraph" would be the compiled step again, and its verdict a false one.
            raise UsageError("cudagraph mode for a torch.compile'd step (its reduce-overhead CUDA graphs) needs --device cuda")
        self._ctx = contextlib.ExitStack()
        if self.collectives is not None:
            # Before the factory, which the contract promises torch.distributed as the re-run
            # provides it: a DTensor model builds its device mesh while it is built.
            self._ctx.enter_context(self.collectives.installed())
        # The recorded program's import context, for the whole re-run (a step may import lazily).
        self._ctx.enter_context(import_context(self.spec.imports))
        if self.make_target is not None:
            target = self.make_target(self)
        else:
            target = build_target(self.spec, rank=self.target_rank, world_size=self.world, device=self.device,
                                  options=self.options, factory=self.factory, compiled=self._compiled())
        if self._compiled() is not None and not target.ran_as.startswith("torch.compile("):
            # A verdict "in compiled" is only ever about a step torch.compile compiled here.
            raise RerunError(f"{self.mode} mode: the step ran as the Python function here, not compiled by torch.compile "
                             f"({target.ran_as or 'nothing compiled it'}): not re-run {self.mode}")
        graphed = None
        if self.mode == "cudagraph" and "cudagraph" not in target.toggles() and not self._compiled():
            if not self.device.startswith("cuda"):
                raise UsageError("cudagraph mode for a target without its own graph runner needs --device cuda")
            graphed = GraphedStep(target)
            # GraphedStep calls the step with keywords: ``*args`` are passed on by position.
            target.step_fn = _CallAsRecorded(target.step_fn)
        if install is not None:
            install(target)
        self._driver = _StepDriver(self.rf, target, self.device, self.collectives, self.spec.outputs, graphed)
        if self.spec.probes:
            from replay.rerun.probes import installed_probes

            self._ctx.enter_context(installed_probes(self.spec.probes, self._driver.probe_sink, self.spec.imports))
        if self.mode == "cudagraph":
            target.prepare()
            target.replaceable_state = False  # a captured graph reads a tensor's memory: never swap one
        self.target = target
        return target

    def goto(self, step: int, *, keyframe_at: int | None = None, progress: Callable[..., Iterable[int]] = lambda it, label="": it,
             live: bool = False) -> StepDeparture | None:
        """Restore the keyframe at or before ``step`` (or ``keyframe_at``) and fast-forward to it.
        ``live``: the target's own state is step ``keyframe_at``'s already; restore nothing."""
        if self.target is None:
            self.build()
        assert self.target is not None and self._driver is not None
        if live and keyframe_at is not None:
            kf_step = min(keyframe_at, step)
        else:
            kf_step = self._restore(step if keyframe_at is None else min(keyframe_at, step))
        self.departed = None
        self.uncompared = []
        self.caught_up = []
        self.keyframe = kf_step
        self.live_start = live
        # Caught up past a later keyframe (a bisection's one launch from its first step): that
        # keyframe is restored when reached, so each step starts from the state ``replay step``
        # gives it; catch-up alone misses what the program did between steps (a buffer the loop
        # changed, a cache it reordered), which the keyframe holds.
        later = [] if live else [k for k in self.rf.keyframe_steps() if kf_step < k <= step]
        self.restored_on_the_way = later
        for s in progress(range(kf_step, step), label=f"rank {self.rank} {self.mode}: steps {kf_step}..{step - 1}"):
            if s in later:
                self._restore(s)
            if self.stream is not None and stream_of(self.rf, s) != self.stream:
                continue  # another model's step: it does not touch this one's state
            self.caught_up.append(s)
            outs = self._driver(s)
            self._raise_if_catch_up_failed(s, step)
            bad, compared = _check_outputs(outs, _recorded_fields(self.rf, s))
            bad = bad or self._collective_field(s) or self._completed_field(s)
            if bad and self.departed is None:
                self.departed = StepDeparture(s, bad)
            if not compared:
                self.uncompared.append(s)  # incl. one that raised as recorded: compared with nothing
        if step in later:
            self._restore(step)
        self.position = step
        return self.departed

    def _restore(self, step: int) -> int:
        """Load the keyframe at or before ``step`` (this stream's state of it) into the target;
        the keyframe's step (0 with none)."""
        kf_step, kf_state = self.keyframe_for(step)
        kf_state = stream_state(self.rf, kf_state, self.stream)
        if kf_state:
            assert self.target is not None
            self.target.load_state(kf_state)
        return kf_step

    def _raise_if_catch_up_failed(self, s: int, step: int) -> None:
        """A catch-up step that raised leaves the state unknown: step ``step`` cannot be re-run.

        Only a step that raised the same kind of error when recorded (a lockstep check) goes on."""
        err = self.last_error
        if err is None:
            return
        view = self.rf.step(s)
        if not view.ok and err.split(":")[0] == view.reason.split(":")[0]:
            return
        when = "completed" if view.ok else f"raised {view.reason}"
        keyframes = self.rf.keyframe_steps()
        restored = self.keyframe in keyframes and not self.live_start
        start = (f"the keyframe at step {self.keyframe}" if restored else
                 f"step {self.keyframe} (no keyframe there: the program's own state)")
        # A step that completed when recorded raises when caught up to: what it read was not
        # there, most often state the program changed between steps, which only a keyframe at
        # each step holds (none to offer when the step has its own keyframe already).
        hint = f"; {KEYFRAME_EVERY_STEP_HINT}" if view.ok and s > self.keyframe and s not in keyframes else ""
        hint += caller_hint(self.spec.caller, self.spec.loop) if view.ok else ""
        raise CatchUpRaised(
            f"rank {self.rank} ({self.mode}): catch-up step {s} raised {err} in the re-run (when recorded it {when}); "
            f"step {step} cannot be re-run from {start}{hint}",
            step=s, keyframe=self.keyframe,
        )

    def run(self, step: int) -> dict[str, torch.Tensor]:
        """Run recorded step ``step`` from the current state; its outputs on the CPU.

        If the step raises (as a recorded step that raised will), ``last_error`` says how and the
        outputs are those its probes saw."""
        assert self._driver is not None, "build() and goto() first"
        outs = self._driver(step)
        self.position = step + 1
        return outs

    @property
    def last_error(self) -> str | None:
        return self._driver.last_error if self._driver is not None else None

    def departure(self, step: int, outs: dict[str, torch.Tensor]) -> StepDeparture | None:
        """Where ``outs`` (this re-run of ``step``) leave the recorded digests; None if they do not.

        A step that raised in the re-run but not when recorded departs too (field ``error``).
        """
        if self.last_error is not None and self.rf.step(step).ok:
            return StepDeparture(step, RAISED_FIELD)  # it raised (its outputs are missing because of that)
        bad = self._completed_field(step) or _departure(outs, _recorded_fields(self.rf, step)) or self._collective_field(step)
        return StepDeparture(step, bad) if bad else None

    def _completed_field(self, step: int) -> str | None:
        """The step completed in the re-run where it raised when recorded: not the recorded path."""
        return COMPLETED_FIELD if self.last_error is None and not self.rf.step(step).ok else None

    def _collective_field(self, step: int) -> str | None:
        """A collective of ``step`` whose input left the recording, as a departure's field."""
        m = self.collectives.departure_at(step) if self.collectives is not None else None
        return m.field if m is not None else None

    def compared(self, step: int, outs: dict[str, torch.Tensor]) -> int:
        """How many of ``step``'s recorded outputs ``outs`` could be compared with (0: none)."""
        return _check_outputs(outs, _recorded_fields(self.rf, step))[1]

    def scan(self, first: int, last: int, *, stop: bool = True) -> StepDeparture | None:
        """Re-run steps up to ``last`` from the keyframe at or before ``first``, teacher-forced.

        Each step from the keyframe on is compared with the recording and the first that departs
        is returned (None: all re-ran as recorded); with ``stop`` the scan ends there, so it runs
        no more steps than it needs. A target without state starts at ``first`` itself, since its
        steps do not depend on each other. ``last_outputs`` holds the outputs of the last step run.
        """
        if self.target is None:
            self.build()
        assert self.target is not None and self._driver is not None
        kf_step = first
        if self.spec.state is not None or self.rf.keyframe(first) is not None:
            kf_step = self._restore(first)
        self.keyframe = kf_step
        self.uncompared = []
        found: StepDeparture | None = None
        for s in range(kf_step, last + 1):
            if self.stream is not None and stream_of(self.rf, s) != self.stream:
                continue  # another model's step (draft and target): not this target's to run
            self.last_outputs = self._driver(s)
            self.position = s + 1
            if self.last_error is None and not self.compared(s, self.last_outputs):
                self.uncompared.append(s)  # nothing recorded to compare with: never "as recorded"
            dep = self.departure(s, self.last_outputs)
            if dep is not None and found is None:
                found = dep
                if stop:
                    break
        return found

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None
        self.target = None
        self._driver = None


@dataclass(kw_only=True, slots=True)
class RerunOptions:
    """How to re-run a step: the settings every re-run entry point shares (issue 18)."""

    modes: tuple[str, ...] = ("eager",)
    device: str = "cpu"
    repeat: int = 1  # runs of the step from the same state (bits that vary: a nondeterministic kernel)
    factory: str | None = None  # overrides the recorded factory
    options: dict[str, Any] = field(default_factory=dict)  # target toggles (--set)
    live_collectives: bool = False  # several ranks in a real process group, not recorded answers
    keyframe_at: int | None = None  # restore the keyframe at or before this step (ranks in lockstep)
    # The target's live state is already this step's (a re-launched program taken over at that
    # step's call): start there, restore no keyframe. One mode only: the run changes that state.
    live_from: int | None = None
    stream: str | None = None  # the model of the part to rebuild (default: the one holding the step)
    make_target: Callable[["Replayer"], Target] | None = None  # instead of the factory (relaunch)
    spec: TargetSpec | None = None  # overrides the recorded target spec
    recording: str = ""  # the recording's path, for the result


def rerun_step(
    part: Part,
    rank: int,
    step: int,
    settings: RerunOptions | None = None,
    *,
    announce: Callable[[str], None] = lambda s: None,
    progress: Callable[..., Iterable[int]] = lambda it, label="": it,
    **keywords: Any,
) -> StepRerun:
    """Re-run ``step`` of ``rank`` in each of ``settings.modes``; see the module docstring.

    ``settings`` (a ``RerunOptions``), or its fields as keywords (``modes=..., device=...``)."""
    if settings is None:
        if "modes" in keywords:
            keywords["modes"] = tuple(keywords["modes"])
        if keywords.get("options") is None:
            keywords.pop("options", None)
        settings = RerunOptions(**keywords)
    elif keywords:
        raise TypeError(f"rerun_step: give RerunOptions or keywords, not both ({', '.join(keywords)})")
    modes = list(dict.fromkeys(settings.modes))
    if settings.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    replayers = [
        Replayer(part, rank, mode=m, device=settings.device, factory=settings.factory, options=settings.options,
                 live_collectives=settings.live_collectives, make_target=settings.make_target, spec=settings.spec,
                 stream=settings.stream, step=step)
        for m in modes
    ]
    first = replayers[0]
    live = settings.live_from is not None
    if live and len(replayers) > 1:
        raise UsageError("a re-run from the re-launched program's own state at a step re-runs one mode (that state "
                         "is changed by the run): give one --mode")
    if settings.live_from is not None:
        kf_step = min(settings.live_from, step)
    else:
        kf_step, _ = first.keyframe_for(step if settings.keyframe_at is None else min(settings.keyframe_at, step))
    first.check(kf_step, step)
    result = StepRerun(recording=settings.recording, part=part.name, rank=rank, step=step, keyframe=kf_step,
                       device=settings.device, factory=first.factory_name, modes={}, stream=first.stream, live_start=live,
                       caller=first.spec.caller or "", loop=first.spec.loop or "")
    if first.factory_name is not None and settings.make_target is None:
        announce(f"importing factory {first.factory_name}" + (" (named by the recording)" if settings.factory is None else " (--factory)"))
    for rp in replayers:
        t0 = time.perf_counter()
        try:
            run = _run_mode(rp, step, kf_step, settings.repeat, result, progress, live=live)
            if not result.state_outside:
                result.state_outside = _state_outside(rp, step)
        finally:
            rp.close()
        _compare_with_recording(run, part, rank, step)
        run.seconds = time.perf_counter() - t0
        result.modes[rp.mode] = run
    _compare_across(result, part, rank, step, modes)
    result.recorded_mode = _recorded_mode(first, step)
    if first.spec.kind is StepKind.COMPILED and "compiled" in result.modes:
        # Recorded compiled: the verdict line and the tables lead with the mode it ran in.
        result.modes = {"compiled": result.modes["compiled"], **result.modes}
    _what_else(result, first, part, rank, step, live=live)
    return result


def _what_else(result: StepRerun, first: Replayer, part: Part, rank: int, step: int, *, live: bool) -> None:
    """What the verdict says beside the comparisons: no keyframe, other ranks' numerics, the
    program's sources, parameters or environment that changed since the recording."""
    if first.rf.keyframe(step) is None:
        result.notes.append(NO_KEYFRAME_NOTE)
    result.notes += _numerics_vs_ranks(part, rank, step)
    result.sources_changed = _sources_changed(first)
    result.parameters_changed = describe_parameter_changes(first.spec.parameters_changed)
    if not live:
        # A factory's re-run runs in this process: its environment is this one (a re-launched
        # program's is compared by the launcher, which set it).
        result.env_differences = environment_moved(first.rf)


def environment_moved(rf: RankFile) -> list[str]:
    """The variables set otherwise here than in the recorded program (digests only: no value
    is kept in the recording)."""
    from replay.core.environment import env_differences

    target = rf.attrs.get("target")
    launch = target.get("launch") if isinstance(target, dict) else None
    return env_differences(launch.get("env_digests"), os.environ) if isinstance(launch, dict) else []


def _numerics_vs_ranks(part: Any, rank: int, step: int, limit: int = 3) -> list[str]:
    """Other ranks that ran this step under other numerics settings (TF32, matmul precision,
    autocast, ...) when recorded: what makes their bits differ from this rank's, as diff says."""
    from replay import numerics

    mine = numerics.recorded_context(part[rank], step)
    if mine is None:
        return []
    notes = []
    for other in sorted(part):
        if other == rank or len(notes) >= limit:
            continue
        try:
            theirs = numerics.recorded_context(part[other], step)
        except Exception:  # noqa: BLE001 - another rank's file is not this step's business
            continue
        if theirs is None or theirs == mine:
            continue
        changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k}: here {numerics.show_setting(mine.get(k))}, rank {other} {numerics.show_setting(theirs.get(k))}" for k in changed[:4])
        notes.append(f"rank {other} ran step {step} under other numerics settings than rank {rank} when recorded: {shown}"
                     f"{', ...' if len(changed) > 4 else ''}")
    return notes


def _sources_changed(rp: Replayer) -> list[str]:
    """The program's recorded source files (its script, the step's module) that differ now."""
    from replay.core.sources import changed_sources
    from replay.rerun.streams import target_info

    info = target_info(rp.rf, rp.stream)
    launch = info.get("launch") if isinstance(info.get("launch"), dict) else {}
    recorded = {**(launch.get("sources") or {} if isinstance(launch.get("sources"), dict) else {}),
                **(info.get("sources") if isinstance(info.get("sources"), dict) else {})}
    return changed_sources(recorded)


def _recorded_mode(rp: Replayer, step: int) -> str:
    """The mode ``step`` ran in when recorded, by the name of the re-run mode that runs it so."""
    if rp.spec.kind is StepKind.COMPILED:
        return "compiled"
    return "cudagraph" if rp.rf.step(step).mode == "graph" else "eager"


def _state_outside(rp: Replayer, step: int) -> str:
    """The class of a step's object that is not a model and gave the step no recorded tensor
    argument (``Engine.step()`` building its batch from its own requests): everything the step
    computes from is that object's Python state, which no keyframe holds. "" otherwise."""
    obj = rp.target.obj if rp.target is not None else None
    if obj is None or isinstance(obj, torch.nn.Module):
        return ""
    if any(name.startswith("input.") for name, _ in rp.rf.step(step).fields()):
        return ""
    return type(obj).__qualname__


def _run_mode(rp: Replayer, step: int, kf_step: int, repeat: int, result: StepRerun,
              progress: Callable[..., Iterable[int]], *, live: bool = False) -> ModeRun:
    """Build, restore, catch up and run the step in ``rp``'s mode (``repeat`` times)."""
    rp.build()
    assert rp.target is not None and rp._driver is not None
    if result.weights is None:
        result.weights = check_weights(rp.target)
    departed = rp.goto(step, keyframe_at=kf_step, progress=progress, live=live)
    if rp.restored_on_the_way:
        ks = rp.restored_on_the_way
        shown = ", ".join(map(str, ks[:6])) + (f", ... ({len(ks)} in all)" if len(ks) > 6 else "")
        note = (f"restored the keyframes at steps {shown} as catch-up reached them (the state they hold; the program's "
                "own state outside them ran on from the steps before)")
        if note not in result.notes:
            result.notes.append(note)
    _note_scalars(rp.target, rp.keyframe, result)
    saved = rp.target.snapshot() if repeat > 1 else None
    # Python's and NumPy's generators as the step is about to read them (restored from the
    # keyframe and advanced by catch-up): each repeat starts from them too.
    host_rng = _host_rng() if repeat > 1 else None
    # The objects held by class name only, as the step is about to take them: a repeat starts
    # from a copy of these too (the run changes them), or is not compared when they cannot be copied.
    held = LiveObjects(rp.rf, step, rp.target.live_args) if repeat > 1 and rp.target.live_args else None
    outs = rp.run(step)
    view = rp.rf.step(step)
    run = ModeRun(mode=rp.mode, outputs=outs, digests={k: digest(v) for k, v in outs.items()}, departed=departed,
                  uncompared=list(rp.uncompared), caught_up=list(rp.caught_up), error=rp.last_error,
                  recorded_error=None if view.ok else view.reason, ran_as=rp.target.ran_as,
                  context_recorded=rp._driver.context_recorded, context_differences=list(rp._driver.context_differences))
    info = getattr(rp.target.obj, "last_run_info", None)
    if isinstance(info, dict):
        run.graph = f"{info.get('mode', '')} {info.get('key', '')}".strip() + (f" ({info['reason']})" if info.get("reason") else "")
    if repeat > 1:
        assert saved is not None
        _repeat(rp, step, repeat, run, (saved, host_rng), held, result)
    if rp.collectives is not None:
        run.collective_mismatches = [str(m) for m in rp.collectives.mismatches]
        at_step = rp.collectives.departure_at(step)
        run.collective_departure = at_step.field if at_step is not None else None
    return run


def _host_rng() -> tuple[Any, Any]:
    """Python's and (when imported) NumPy's global generator states."""
    import random

    np_random = getattr(sys.modules.get("numpy"), "random", None)
    return random.getstate(), np_random.get_state() if np_random is not None else None


def _set_host_rng(state: tuple[Any, Any]) -> None:
    import random

    random.setstate(state[0])
    np_random = getattr(sys.modules.get("numpy"), "random", None)
    if state[1] is not None and np_random is not None:
        np_random.set_state(state[1])


def _repeat(rp: Replayer, step: int, repeat: int, run: ModeRun, start: tuple[dict[str, Any], tuple[Any, Any]],
            held: LiveObjects | None, result: StepRerun) -> None:
    """The step's repeats, each from the state, the host generators and the copies of held
    objects it first ran from."""
    saved, host_rng = start
    for i in range(repeat - 1):
        rp.target.load_state(saved)
        _set_host_rng(host_rng)
        if held is not None:
            rp.target.live_args = held.fresh(rp.target.live_args)
        run.repeat_digests.append({k: digest(v) for k, v in rp.run(step).items()})
        if rp.last_error != run.error:
            # Raised (or not) otherwise than the first run: its bits say nothing about kernels.
            how = f"raised {rp.last_error}" if rp.last_error else "completed"
            first = f"raised {run.error}" if run.error else "completed"
            result.notes.append(f"--repeat not compared: repeat {i + 2} {how} where the first run {first}: the step reads "
                                "state a repeat does not restore (a module global, a counter, an object outside the "
                                "model), so its repeats are not runs of the same step")
            return
    if held is not None and held.uncopied:
        # The repeats did not start from the same state: their bits say nothing about kernels.
        note = (f"--repeat not compared: the step's argument {', '.join(held.uncopied)}, held by class name only, could "
                "not be copied, so each repeat started from what the last one left in it")
        if note not in result.notes:
            result.notes.append(note)
        return
    run.repeats_equal = all(d == run.digests for d in run.repeat_digests)


def _note_scalars(target: Target, keyframe: int, result: StepRerun) -> None:
    """Say which Python scalars of the target (a step counter) the keyframe restored, and which
    it could not: a counter left at its fresh value makes the engine compute or say otherwise."""
    shown = ", ".join(f"{k}={v!r}" for k, v in list(target.restored_scalars.items())[:8])
    notes = []
    if shown:
        notes.append(f"restored the target's Python state from the keyframe at step {keyframe}: {shown}"
                     + (", ..." if len(target.restored_scalars) > 8 else ""))
    if target.restored_generators:
        gens = ", ".join(target.restored_generators[:8])
        notes.append(f"restored the state of the generator(s) the target holds (torch.Generator, numpy.random.Generator, random.Random) from the keyframe at step {keyframe}: {gens}")
    if target.unrestored_scalars:
        notes.append(f"the keyframe at step {keyframe} holds Python state the rebuilt target has no attribute of that "
                     f"type for ({', '.join(target.unrestored_scalars[:8])}): not restored")
    result.notes.extend(n for n in notes if n not in result.notes)


def _compare_with_recording(run: ModeRun, part: Part, rank: int, step: int) -> None:
    """Each output against the rank's recorded digest (or ring logits), and the ranks it matches."""
    rf = part[rank]
    recorded = _recorded_fields(rf, step)
    ring = _ring_logits(rf, step)
    mine, theirs = f"{run.mode} re-run", f"rank {rank} recorded"
    for name, t in run.outputs.items():
        key = next((p + name for p in ("output.", "tokens.") if p + name in recorded), None)
        with_ring = name == "logits" and ring is not None and ring.shape == t.shape
        if with_ring:
            assert ring is not None
            run.vs_recording[name] = compare_tensors(t, ring, name_a=mine, name_b=theirs)
        elif key is not None:
            run.vs_recording[name] = compare_digests(run.digests[name], recorded[key], name_a=mine, name_b=theirs)
        if key is not None:
            run.matches_ranks[name] = _ranks_with(part, step, key, run.digests[name])
        elif with_ring:
            run.matches_ranks[name] = _ranks_with_ring_logits(part, step, run.digests[name])
    if run.error is None:
        # A recorded output the re-run did not return is a difference, never a silent skip.
        for key in recorded:
            prefix, _, name = key.partition(".")
            if prefix in ("output", "tokens") and name not in run.outputs and name not in run.vs_recording:
                run.vs_recording[name] = Comparison(mine, theirs, Verdict.DIFFERENT, note="recorded, but not returned by the re-run")


def _compare_across(result: StepRerun, part: Part, rank: int, step: int, modes: list[str]) -> None:
    """The two modes against each other, and the first mode's logits against the other ranks'."""
    if len(modes) == 2:
        a, b = (result.modes[m] for m in modes)
        for name in sorted(a.outputs.keys() & b.outputs.keys()):
            result.comparisons.append(compare_tensors(a.outputs[name], b.outputs[name], name_a=f"{modes[0]} {name}",
                                                      name_b=f"{modes[1]} {name}"))
    head = result.modes[modes[0]]
    if "logits" not in head.outputs:
        return
    for r, other in part.items():
        if r == rank:
            continue
        try:
            lg = _ring_logits(other, step)  # where the other rank's ring kept this step
        except RecordingDamaged as e:
            result.notes.append(f"rank {r}'s recorded logits not compared: {e}")
            continue
        if lg is not None and lg.shape == head.outputs["logits"].shape:
            # Named for the field: the logits may agree where the step's other outputs (its
            # sampled tokens) do not, as the verdict table's "same bits as ranks" says.
            c = compare_tensors(head.outputs["logits"], lg, name_a=f"{modes[0]} re-run logits", name_b=f"rank {r} recorded logits")
            shifted = None if c.equal else _offset_logits(other, step, head.outputs["logits"])
            if shifted is not None:
                # The ranks are offset by a call or two (info says so): this step is another
                # step number there; the same number is another step, and no difference.
                c = compare_tensors(head.outputs["logits"], shifted[1], name_a=f"{modes[0]} re-run logits",
                                    name_b=f"rank {r} recorded logits of its step {shifted[0]}")
                result.notes.append(f"rank {r}'s step {step} is another step: the same logits are its step {shifted[0]} "
                                    f"(the ranks are offset by {abs(shifted[0] - step)} call(s) of the step, as info says)")
            result.comparisons.append(c)


def _offset_logits(other: RankFile, step: int, logits: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(step, logits) of ``other``'s ring at a step a call or two from ``step`` holding these
    same bits, or None."""
    for k in (1, -1, 2, -2):
        lg = _ring_logits(other, step + k)
        if lg is not None and lg.shape == logits.shape and compare_tensors(logits, lg).equal:
            return step + k, lg
    return None


def default_modes(part: Part, rank: int, step: int, device: str, *, relaunch: bool = False) -> list[str]:
    """The modes a re-run of ``step`` runs when ``--mode`` is not given: what this recording and
    this machine can run. On the CPU: eager, and compiled again for a step recorded compiled when
    its torch.compile arguments are known (recorded, or seen by a re-launched program); on a GPU:
    eager and cudagraph, to compare the two."""
    rf = part[rank]
    spec = TargetSpec.from_rank_file(rf, stream_of(rf, step))
    if device.startswith("cuda") and torch.cuda.is_available():
        return ["eager", "cudagraph"]
    if spec.factory and not relaunch and rf.step(step).mode == "graph":
        # A graph runner of the engine's own ran this step (on the CPU too, as the reference
        # engine's does): its factory rebuilds it with cudagraph on, so compare both.
        return ["eager", "cudagraph"]
    if spec.kind is StepKind.COMPILED and (spec.compile or relaunch):
        return ["eager", "compiled"]  # eager first: an error it meets is plain (Dynamo wraps one in compiled)
    return ["eager"]


def verdict_matches(c: Comparison) -> bool:
    return c.verdict is Verdict.BITWISE_EQUAL
