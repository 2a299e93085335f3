"""Rebuilding a recorded target from the factory its recording names.

The factory contract (for any engine)::

    factory(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> target

``config`` is what the recording stored (the profile's ``config`` accessor); ``options`` overrides
toggles: ``cudagraph`` (bool), ``tuner_choices`` ({op: tactic}, the recorded rank's winners) and
whatever ``replay bisect --config`` flips. The factory must not initialise torch.distributed: the
re-run provides it (recorded collectives for one rank alone, live ones for several ranks).
The target's step method is the one recorded (``module:Class.method``); its state is reached
through the recorded accessor. An optional ``capture_graphs()`` is called before state is
restored, so graph warm-up cannot overwrite restored state.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from replay.errors import FactoryError, OutOfRange, RerunError
from replay.core.state import (capture_generators, capture_scalars, held_module_state, module_state, named_state, restore_generators, restore_scalars, split_generators,
                               split_scalars)
from replay.format.reader import RankFile
from replay.rerun.imports import ImportContext, import_recorded

__all__ = ["StepKind", "TargetSpec", "Target", "build_target", "resolve_factory"]


class StepKind(enum.Enum):
    """What the recorded step callable is (``attrs["target"]["step_kind"]``, or found on re-run)."""

    FUNCTION = "function"
    METHOD = "method"
    MODULE_FORWARD = "module_forward"  # an nn.Module class named as the step: its instances' forward
    COMPILED = "compiled"  # a function compiled with torch.compile

    @classmethod
    def parse(cls, value: Any) -> "StepKind | None":
        try:
            return cls(value)
        except ValueError:
            return None


@dataclass(slots=True)
class TargetSpec:
    step: str
    factory: str | None
    config: Any
    state: str | None
    modules: str | None
    device: str
    outputs: list[str] = field(default_factory=list)
    profile: str | None = None
    probes: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    kind: StepKind | None = None  # None: an older recording; found when the step is resolved
    imports: ImportContext = field(default_factory=ImportContext)
    compile: dict[str, Any] = field(default_factory=dict)  # recorded torch.compile arguments of the step
    stream: str | None = None  # the model (stream) of the part this target is
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)  # {name: {digest, shape, dtype}}
    caller: str | None = None  # the program's function that called the step (module:qualname)
    loop: str | None = None  # the program's function that runs the loop around the step
    # Calls of the step the program made before the recorded step 0 (a step found with no flags
    # misses the first): the first keyframe holds the state they left, not the state as built.
    unrecorded_calls: int = 0
    # How the model's parameters changed in names or shapes after its first recorded step
    # (``replay.core.weights.parameter_changes``; empty: they did not, or an older recording).
    parameters_changed: dict[str, Any] = field(default_factory=dict)
    # issue 16: the rank file the names came from (None: a spec the caller built), for replay.trust
    origin: Any = None

    @classmethod
    def from_rank_file(cls, rf: RankFile, stream: str | None = None) -> "TargetSpec":
        """The recorded target of ``rf``; ``stream``: one model of a part holding several."""
        t = _recorded_target(rf, stream)
        return cls(
            step=t["step"],
            factory=_text(t, "factory"),
            config=t.get("config"),
            state=_text(t, "state"),
            modules=_text(t, "modules"),
            device=str(t.get("device") or "cpu"),
            outputs=[str(x) for x in t.get("outputs") or []],
            profile=_text(t, "profile"),
            probes=_probes(t.get("probes")),
            kind=StepKind.parse(t.get("step_kind")),
            imports=ImportContext.from_target(t),
            compile=dict(t["compile"]) if isinstance(t.get("compile"), dict) else {},
            stream=_text(t, "stream"),
            caller=_text(t, "caller"),
            loop=_text(t, "loop"),
            unrecorded_calls=t["unrecorded_calls"] if isinstance(t.get("unrecorded_calls"), int) else 0,
            weights=_weights(t.get("weights")),
            parameters_changed=dict(t["parameters_changed"]) if isinstance(t.get("parameters_changed"), dict) else {},
            origin=rf,  # issue 16
        )


def _recorded_target(rf: RankFile, stream: str | None) -> dict[str, Any]:
    """``attrs["target"]``, with ``stream``'s own step, config, state and weights over the
    part's (launch and numerics are the part's)."""
    t = rf.attrs.get("target")
    if isinstance(t, dict) and stream is not None:
        streams = t.get("streams") if isinstance(t.get("streams"), dict) else {}
        if stream not in streams and stream != t.get("stream"):
            names = ", ".join(sorted(streams)) or str(t.get("stream"))
            raise OutOfRange(f"rank {rf.rank} has no stream {stream!r} (streams: {names})")
        if isinstance(streams.get(stream), dict):
            t = {**t, **streams[stream], "stream": stream}
    if not isinstance(t, dict) or not isinstance(t.get("step"), str):
        raise RerunError(
            f"rank {rf.rank} recorded no step target: it was recorded without `replay record --step` "
            "or a profile, so it cannot be re-run"
        )
    return t


def _text(t: dict[str, Any], key: str) -> str | None:
    v = t.get(key)
    return v if isinstance(v, str) else None


def _probes(raw: Any) -> list[tuple[str, tuple[str, ...]]]:
    return [(str(p[0]), tuple(str(n) for n in p[1])) for p in raw or []
            if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)]


def _weights(raw: Any) -> dict[str, dict[str, Any]]:
    return {str(k): v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}


def resolve_factory(name: str, imports: ImportContext | None = None) -> Callable[..., Any]:
    fac = import_recorded(name, "factory", imports)
    if not callable(fac):
        raise FactoryError(f"factory {name} is not callable")
    return fac


def _unwrapped(fn: Any) -> Any:
    """The program's own function under the recorder's wrapper (a process being recorded that
    re-runs a step): only that wrapper is removed, never the program's own decorators."""
    while getattr(fn, "__replay_wrapped__", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def uncompiled(fn: Any) -> Any:
    """The Python function under ``torch.compile`` (the function itself when not compiled)."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "_orig_mod", None) or fn


class Target:
    """A rebuilt target: its step callable, live state, module tree and declared toggles."""

    def __init__(self, spec: TargetSpec, obj: Any, step_fn: Callable[..., Any], device: str,
                 kind: StepKind = StepKind.METHOD) -> None:
        self.spec = spec
        self.obj = obj
        self.step_fn = step_fn
        self.device = device
        self.kind = kind
        self.ran_as = ""  # how the step callable runs, when the kind says (compiled or not)
        # The program's own values of the step's arguments that are neither data nor the target
        # (a re-launched program's objects at the step's first call): passed again as they are.
        self.live_args: dict[str, Any] = {}
        # The Python scalars (a step counter) the last load_state set, and those it could not.
        self.restored_scalars: dict[str, Any] = {}
        self.unrestored_scalars: list[str] = []
        self.restored_generators: list[str] = []  # paths of the target's generators the last load_state set
        self._built_scalars: dict[str, Any] | None = None  # the scalars as built, before any keyframe
        self.option_names: set[str] = set()  # the re-run's --set toggles: the factory's to set, never a keyframe's
        # The recorded program's own objects (a re-launched program), not a rebuilt target: its
        # scalars that looked like configuration are set back to their recorded values too.
        self.own_objects = False
        # Whether a keyframe tensor of another shape may replace the program's own (not once CUDA
        # graphs may have captured the old one's memory).
        self.replaceable_state = True

    def state(self) -> dict[str, torch.Tensor]:
        if self.obj is None:
            return {}
        if self.spec.state is None:
            # An nn.Module target's default state: its buffers and non-parameter tensors, named
            # as the recorder names them (replay.record.calls.module_state).
            if isinstance(self.obj, torch.nn.Module):
                return module_state(self.obj)
            # An engine object holding one model: that model's buffers, as the recorder keeps them.
            return held_module_state(self.obj) or {}
        attr: Any = self.obj
        for part in self.spec.state.split("."):
            attr = getattr(attr, part)
        value = attr() if callable(attr) and not isinstance(attr, torch.nn.Module) else attr
        return named_state(value, self.spec.state)

    def module(self) -> torch.nn.Module | None:
        if self.obj is None:
            return None
        if self.spec.modules:
            attr: Any = self.obj
            for part in self.spec.modules.split("."):
                attr = getattr(attr, part, None)
            if isinstance(attr, torch.nn.Module):
                return attr
        if isinstance(self.obj, torch.nn.Module):
            return self.obj
        mods = [v for v in vars(self.obj).values() if isinstance(v, torch.nn.Module)] if hasattr(self.obj, "__dict__") else []
        return mods[0] if len(mods) == 1 else None

    def toggles(self) -> dict[str, list[Any]]:
        fn = getattr(self.obj, "replay_toggles", None)
        if callable(fn):
            try:
                return {str(k): list(v) for k, v in dict(fn()).items()}
            except Exception:  # noqa: BLE001
                return {}
        return {}

    def prepare(self) -> None:
        """Capture graphs now (before state is restored), if the target can say so."""
        fn = getattr(self.obj, "capture_graphs", None)
        if callable(fn):
            fn()

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a keyframe: its tensors in place, and the object's Python scalars it holds."""
        unchanged: dict[str, Any] = {}
        tensors, generators = split_generators(tensors)
        tensors, scalars = split_scalars(tensors, unchanged)
        if self._built_scalars is None:
            self._built_scalars = split_scalars(capture_scalars(self.obj))[1] if self.obj is not None else {}
        # Back to the values the target was built with first: a keyframe holds only the scalars
        # that had changed since the first one, and a target re-used from a later step (bisection
        # probes, repeats) must not carry its counter into an earlier interval.
        restore_scalars(self.obj, self._built_scalars)
        if (self.own_objects or self.spec.unrecorded_calls > 0) and self.obj is not None:
            # The program's own object: nothing to hide about how it was configured, and its
            # calls before the recorded ones (a step found with no flags) may have moved a value.
            # A rebuilt one, when the program called the step before step 0: the first keyframe
            # holds what those calls left (a counter the prefill moved), not the values as built.
            live = split_scalars(capture_scalars(self.obj))[1]
            scalars = {**{k: v for k, v in unchanged.items()
                          if k in live and live[k] != v and k.rsplit(".", 1)[-1] not in self.option_names}, **scalars}
        self.unrestored_scalars = restore_scalars(self.obj, scalars)
        self.restored_scalars = {k: v for k, v in scalars.items() if k not in self.unrestored_scalars}
        # The target's own generators (a sampler's): drawn from as they were at the keyframe.
        failed = restore_generators(self.obj, generators)
        self.unrestored_scalars += [f"generator {g}" for g in failed]
        self.restored_generators = sorted(set(generators) - set(failed))
        live = self.state()
        missing = sorted(set(tensors) - set(live))
        if missing:
            raise RerunError(f"the rebuilt target has no state named {', '.join(missing[:5])} (the recording has it)")
        for name, t in tensors.items():
            dst = live[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                if self._replace(name, dst, t):
                    continue
                why = ("the program changes its shape between steps (a cache it grows or replaces), and this tensor "
                       "cannot be replaced here" if self.own_objects else "was the target built from another config?")
                raise RerunError(f"state {name!r}: recorded {tuple(t.shape)} {t.dtype}, "
                                 f"{'the program has' if self.own_objects else 'rebuilt'} {tuple(dst.shape)} {dst.dtype}; {why}")
            dst.copy_(t.to(dst.device))

    def _replace(self, name: str, dst: torch.Tensor, recorded: torch.Tensor) -> bool:
        """The program's own module whose buffer (or tensor attribute) the loop grows or swaps
        between steps: set the recorded tensor in its place, as the program would have. Not for a
        rebuilt target (another shape there is another config) nor an engine that captured its
        own CUDA graphs (they read the old tensor's memory)."""
        if (not self.own_objects or not self.replaceable_state or not isinstance(self.obj, torch.nn.Module)
                or callable(getattr(self.obj, "capture_graphs", None))):
            return False
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = self.obj.get_submodule(owner_path) if owner_path else self.obj
        except AttributeError:
            return False
        if getattr(owner, leaf, None) is not dst:
            return False
        setattr(owner, leaf, recorded.to(dst.device).clone())
        return True

    def snapshot(self) -> dict[str, torch.Tensor]:
        snap = {k: v.detach().clone() for k, v in self.state().items()}
        if self.obj is not None:
            snap.update(capture_scalars(self.obj))
            snap.update(capture_generators(self.obj))
        return snap


def build_target(
    spec: TargetSpec,
    *,
    rank: int,
    world_size: int,
    device: str,
    options: dict[str, Any],
    factory: str | None = None,
    compiled: str | None = None,
) -> Target:
    """Import the factory (``factory`` overrides the recorded one) and build the target.

    ``compiled``: for a function step, compile it again with torch.compile (``"recorded"``: the
    recorded arguments; ``"cudagraph"``: with CUDA graphs); None runs the Python function."""
    fac_name = factory or spec.factory
    kind = spec.kind
    if kind is None and "." in spec.step.partition(":")[2]:
        kind = StepKind.METHOD  # an older recording: a method, found on the factory's object
    # issue 16: nothing a recording names is imported without the user's consent (replay/trust.py)
    if spec.origin is not None:
        from replay import trust

        named = ([] if factory or fac_name is None else [fac_name]) + ([] if kind is StepKind.METHOD else [spec.step])
        trust.admit(spec.origin, named + [p for p, _ in spec.probes], user_names=[factory] if factory else [])
    resolved, kind = _resolve_step(spec, kind, fac_name)
    if kind in (StepKind.METHOD, StepKind.MODULE_FORWARD) and fac_name is None:
        what = "an nn.Module class: its forward" if kind is StepKind.MODULE_FORWARD else "a method"
        raise FactoryError(
            f"the recording names no factory for {spec.step} ({what}): pass --factory module:qualname "
            "(a callable (config, *, rank, world_size, device, options) -> target)"
        )
    obj = _call_factory(spec, fac_name, rank=rank, world_size=world_size, device=device, options=options) if fac_name else None
    if kind is StepKind.METHOD:
        method = spec.step.partition(":")[2].split(".")[-1]
        step_fn = getattr(obj, method, None)
        if not callable(step_fn):
            raise FactoryError(f"the object built by {fac_name} has no method {method} (recorded step {spec.step})")
    elif kind is StepKind.MODULE_FORWARD:
        obj = _instance_of(obj, resolved, spec, fac_name)
        # forward of the instance, as recorded: never the class (its constructor) with step inputs.
        forward = _unwrapped(type(obj).forward)
        step_fn = forward.__get__(obj, type(obj))
    else:
        step_fn, ran_as = function_step(_unwrapped(resolved), kind, spec, compiled)
        target = Target(spec, obj, step_fn, device, kind=kind)
        target.ran_as = ran_as
        return target
    step_fn, ran_as = bound_step(step_fn, spec, compiled)
    target = Target(spec, obj, step_fn, device, kind=kind)
    target.ran_as = ran_as
    target.option_names = {str(k).rsplit(".", 1)[-1] for k in options}
    return target


def _resolve_step(spec: TargetSpec, kind: StepKind | None, fac_name: str | None) -> tuple[Any, StepKind]:
    """The recorded step's callable (None for a method, found on the factory's object) and its
    kind. Never imported when no factory could build its object: importing a class defined in
    the recorded script runs the whole script (its loop) in this process."""
    if kind in (StepKind.METHOD, StepKind.MODULE_FORWARD) and fac_name is None:
        return None, kind
    resolved = import_recorded(spec.step, "step", spec.imports) if kind is not StepKind.METHOD else None
    kind = kind or _kind_of(resolved, spec.step)
    assert kind is not None
    return resolved, kind


def bound_step(step_fn: Callable[..., Any], spec: TargetSpec, compiled: str | None) -> tuple[Callable[..., Any], str]:
    """A method's or a module forward's bound step, and how it runs: as it is, or (``compiled``)
    compiled for real by torch.compile (before: the Python method ran and was reported as compiled)."""
    if compiled is None:
        return step_fn, ""
    return function_step(step_fn, StepKind.COMPILED, spec, compiled)


COMPILE_ARGS = ("fullgraph", "dynamic", "backend", "mode", "options")


def compile_arguments(spec: TargetSpec, compiled: str | None) -> dict[str, Any]:
    """torch.compile's arguments for a re-run: as recorded (``compiled="recorded"``), or with
    CUDA graphs (``"cudagraph"``: ``mode="reduce-overhead"`` unless another graph mode was recorded)."""
    kw = {k: v for k, v in spec.compile.items() if k in COMPILE_ARGS and v is not None}
    if compiled == "cudagraph" and kw.get("mode") not in ("reduce-overhead", "max-autotune"):
        kw["mode"] = "reduce-overhead"
    return kw


def function_step(fn: Any, kind: StepKind, spec: TargetSpec, compiled: str | None) -> tuple[Callable[..., Any], str]:
    """The step function to call, and how it runs: compiled again, or the plain Python function."""
    base = uncompiled(fn)
    if compiled is None:
        if kind is StepKind.COMPILED or base is not fn:
            return base, "eager: the Python function, uncompiled (recorded compiled)"
        return base, ""
    kw = compile_arguments(spec, compiled)
    shown = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    fn_compiled = torch.compile(base, **kw)
    if fn_compiled is base or uncompiled(fn_compiled) is fn_compiled:
        # Never report "torch.compile(...)" over a step that would run as the Python function
        # (a torch.compile replaced by the program, or by replay's own re-launch hook).
        raise RerunError(f"torch.compile({shown}) returned {getattr(base, '__qualname__', 'the step')} uncompiled "
                         "here: the step cannot be re-run compiled")
    ran_as = f"torch.compile({shown})"
    if not spec.compile and spec.kind is not StepKind.COMPILED:
        ran_as += " of a step recorded uncompiled: inductor's kernels may round otherwise than the recorded ones"
    return _compiled_for_sure(fn_compiled, base, shown), ran_as


def _compiled_for_sure(fn_compiled: Callable[..., Any], base: Any, shown: str) -> Callable[..., Any]:
    """``fn_compiled``, checked once after its first call: Dynamo must then hold compiled code
    for the step's code object. A re-run that silently ran the Python function (Dynamo disabled,
    or not running where the call was made) raises instead of being reported as compiled."""
    code = getattr(base, "__code__", None)
    checked = [code is None]

    def step_compiled(*args: Any, **kwargs: Any) -> Any:
        frames = _dynamo_frames() if not checked[0] else 0
        out = fn_compiled(*args, **kwargs)
        if not checked[0]:
            checked[0] = True
            try:
                from torch._dynamo.eval_frame import _debug_get_cache_entry_list
            except ImportError:  # another torch: nothing to check with
                return out
            # Dynamo may leave the step's own frame to Python (a graph break it cannot resume
            # from, as with ``dynamic=True`` on an HF-style forward) and compile the frames it
            # calls: that is how torch.compile runs this step, in the recording too.
            if not _debug_get_cache_entry_list(code) and _dynamo_frames() <= frames:
                raise RerunError(f"torch.compile({shown}) ran {getattr(base, '__qualname__', 'the step')} without "
                                 "compiling it (Dynamo did not run here): the step was not re-run compiled")
        return out

    return step_compiled


def _dynamo_frames() -> int:
    """How many frames Dynamo has looked at in this process (its own counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["frames"]["total"])


def _kind_of(resolved: Any, name: str) -> StepKind:
    if isinstance(resolved, type):
        if issubclass(resolved, torch.nn.Module):
            return StepKind.MODULE_FORWARD
        raise FactoryError(f"step {name} is a class but not an nn.Module: name a method (module:Class.method)")
    if uncompiled(resolved) is not resolved:
        return StepKind.COMPILED
    if inspect.ismethod(resolved) or "." in name.partition(":")[2]:
        return StepKind.METHOD
    return StepKind.FUNCTION


def _call_factory(spec: TargetSpec, fac_name: str, *, rank: int, world_size: int, device: str, options: dict[str, Any]) -> Any:
    fac = resolve_factory(fac_name, spec.imports)
    try:
        inspect.signature(fac).bind(spec.config, rank=rank, world_size=world_size, device=device, options=options)
    except (TypeError, ValueError):
        raise FactoryError(f"factory {fac_name} does not take (config, *, rank, world_size, device, options)") from None
    try:
        return fac(spec.config, rank=rank, world_size=world_size, device=device, options=options)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - the factory is user code (issue 16: exits too)
        raise FactoryError(f"factory {fac_name} failed: {e.__class__.__name__}: {e}") from None


def _instance_of(obj: Any, cls: Any, spec: TargetSpec, fac_name: str | None) -> torch.nn.Module:
    """The instance of the recorded nn.Module class: what the factory built, or the one it holds."""
    want = cls if isinstance(cls, type) else torch.nn.Module
    if isinstance(obj, want):
        return obj
    held = [getattr(obj, spec.modules, None)] if spec.modules else []
    held += [v for v in vars(obj).values()] if hasattr(obj, "__dict__") else []
    held += list(obj.children()) if isinstance(obj, torch.nn.Module) else []  # submodules live in _modules
    for v in held:
        if isinstance(v, want):
            return v
    raise FactoryError(f"factory {fac_name} built {type(obj).__name__}, not an instance of {spec.step} (nor an object holding one)")
