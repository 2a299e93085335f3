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

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from replay.errors import FactoryError, RerunError
from replay.format.reader import RankFile

__all__ = ["TargetSpec", "Target", "build_target", "resolve_factory"]


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
    # issue 16: the rank file the names came from (None: a spec the caller built), for replay.trust
    origin: Any = None

    @classmethod
    def from_rank_file(cls, rf: RankFile) -> "TargetSpec":
        t = rf.attrs.get("target")
        if not isinstance(t, dict) or not isinstance(t.get("step"), str):
            raise RerunError(
                f"rank {rf.rank} recorded no step target: it was recorded without `replay record --step` "
                "or a profile, so it cannot be re-run"
            )
        return cls(
            step=t["step"],
            factory=t.get("factory") if isinstance(t.get("factory"), str) else None,
            config=t.get("config"),
            state=t.get("state") if isinstance(t.get("state"), str) else None,
            modules=t.get("modules") if isinstance(t.get("modules"), str) else None,
            device=str(t.get("device") or "cpu"),
            outputs=[str(x) for x in t.get("outputs") or []],
            profile=t.get("profile") if isinstance(t.get("profile"), str) else None,
            probes=[(str(p[0]), tuple(str(n) for n in p[1])) for p in t.get("probes") or []
                    if isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)],
            origin=rf,  # issue 16
        )


def _import_qualified(name: str, what: str) -> Any:
    if not isinstance(name, str) or ":" not in name:
        raise FactoryError(f"{what} {name!r} is not of the form module:qualname")
    mod, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as e:
        raise FactoryError(f"cannot import {mod} for {what} {name} ({e}); is the package installed here?") from None
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - user code failed while importing (issue 16: exits too)
        raise FactoryError(f"importing {mod} for {what} {name} failed: {e.__class__.__name__}: {e}") from None
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"{mod} has no {qual} ({what} {name})") from None
    return obj


def resolve_factory(name: str) -> Callable[..., Any]:
    fac = _import_qualified(name, "factory")
    if not callable(fac):
        raise FactoryError(f"factory {name} is not callable")
    return fac


class Target:
    """A rebuilt target: its step callable, live state, module tree and declared toggles."""

    def __init__(self, spec: TargetSpec, obj: Any, step_fn: Callable[..., Any], device: str) -> None:
        self.spec = spec
        self.obj = obj
        self.step_fn = step_fn
        self.device = device

    def state(self) -> dict[str, torch.Tensor]:
        if self.spec.state is None or self.obj is None:
            return {}
        attr: Any = self.obj
        for part in self.spec.state.split("."):
            attr = getattr(attr, part)
        value = attr() if callable(attr) else attr
        return dict(value or {})

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
        live = self.state()
        missing = sorted(set(tensors) - set(live))
        if missing:
            raise RerunError(f"the rebuilt target has no state named {', '.join(missing[:5])} (the recording has it)")
        for name, t in tensors.items():
            dst = live[name]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise RerunError(
                    f"state {name!r}: recorded {tuple(t.shape)} {t.dtype}, rebuilt {tuple(dst.shape)} {dst.dtype}; "
                    "was the target built from another config?"
                )
            dst.copy_(t.to(dst.device))

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state().items()}


def build_target(
    spec: TargetSpec,
    *,
    rank: int,
    world_size: int,
    device: str,
    options: dict[str, Any],
    factory: str | None = None,
) -> Target:
    """Import the factory (``factory`` overrides the recorded one) and build the target."""
    mod, _, qual = spec.step.partition(":")
    is_method = "." in qual
    fac_name = factory or spec.factory
    # issue 16: nothing a recording names is imported without the user's consent (replay/trust.py)
    if spec.origin is not None:
        from replay import trust

        named = ([] if factory or fac_name is None else [fac_name]) + ([] if is_method else [spec.step])
        trust.admit(spec.origin, named + [p for p, _ in spec.probes], user_names=[factory] if factory else [])
    obj: Any = None
    if fac_name is None:
        if is_method:
            raise FactoryError(
                f"the recording names no factory for {spec.step}: pass --factory module:qualname "
                "(a callable (config, *, rank, world_size, device, options) -> target)"
            )
    else:
        fac = resolve_factory(fac_name)
        try:
            inspect.signature(fac).bind(spec.config, rank=rank, world_size=world_size, device=device, options=options)
        except (TypeError, ValueError):
            raise FactoryError(
                f"factory {fac_name} does not take (config, *, rank, world_size, device, options)"
            ) from None
        try:
            obj = fac(spec.config, rank=rank, world_size=world_size, device=device, options=options)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - the factory is user code (issue 16: exits too)
            raise FactoryError(f"factory {fac_name} failed: {e.__class__.__name__}: {e}") from None
    if is_method:
        method = qual.split(".")[-1]
        step_fn = getattr(obj, method, None)
        if not callable(step_fn):
            raise FactoryError(f"the object built by {fac_name} has no method {method} (recorded step {spec.step})")
    else:
        step_fn = _import_qualified(spec.step, "step")
    # The recorder's wrapper, if this process is itself being recorded, must not see re-runs.
    step_fn = getattr(step_fn, "__wrapped__", step_fn) if not is_method else step_fn
    return Target(spec, obj, step_fn, device)
