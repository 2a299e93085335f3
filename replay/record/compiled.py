"""``torch.compile`` under the recorder: steps are recorded at the compiled callable's boundary.

``torch.compile`` is wrapped so that a compiled function comes back inside a thin eager wrapper
(the boundary): Dynamo never traces the recorder (no lock, no thread-local, no file I/O on the
traced path), and the session can treat the compiled function as a step. A recorder step
wrapper given to ``torch.compile`` has its original compiled, and the step is then recorded
around the compiled result. Compiled ``nn.Module``s (``OptimizedModule``) are returned as they
are: their steps are recorded where their class's ``forward`` is named or found eagerly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["install", "BOUNDARY", "is_compiled_callable", "arguments_for"]

BOUNDARY = "__replay_boundary__"
_ORIG = "__replay_original__"
# torch.compile's arguments per compiled callable (``module:qualname``, a module by its class),
# as the program passed them: written into the target info, a re-run compiles the same way.
_ARGS: dict[str, dict[str, Any]] = {}
# Our global module hooks (step discovery) make torch warn at each compiled module's call that
# the hooks fire twice: that is the recorder's business, not the program's output.
_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def arguments_for(step: str) -> dict[str, Any]:
    """The recorded ``torch.compile`` arguments of the step named ``step`` ({} if not compiled)."""
    return dict(_ARGS.get(step) or {})


def _backend_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend
    return str(getattr(backend, "__name__", None) or getattr(backend, "compiler_name", None) or type(backend).__name__)


def _module_of(fn: Any) -> torch.nn.Module | None:
    """The module whose call ``fn`` is: its bound ``forward`` (``m.forward = torch.compile(m.forward)``)
    or ``_call_impl`` (what ``m.compile()`` hands to torch.compile)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", "") in ("forward", "_call_impl"):
        return owner
    return None


def _remember(model: Any, kwargs: dict[str, Any]) -> None:
    from replay.record.calls import NotJSON, to_json_safe
    from replay.record.launch import module_name

    obj = type(model) if isinstance(model, torch.nn.Module) else model
    step = f"{module_name(getattr(obj, '__module__', '') or '?')}:{getattr(obj, '__qualname__', '?')}"
    args: dict[str, Any] = {"fullgraph": bool(kwargs.get("fullgraph", False)), "dynamic": kwargs.get("dynamic"),
                            "backend": _backend_name(kwargs.get("backend", "inductor")), "mode": kwargs.get("mode")}
    if not isinstance(kwargs.get("backend", "inductor"), str):
        args["backend_callable"] = True  # a re-run cannot pass a callable by name: it says so
    if kwargs.get("options") is not None:
        try:
            args["options"] = to_json_safe(kwargs["options"])
        except NotJSON:
            args["options"] = {"unrecorded": type(kwargs["options"]).__name__}
    _ARGS[step] = args


def is_compiled_callable(fn: Any) -> bool:
    return bool(getattr(fn, BOUNDARY, False) or getattr(fn, "_torchdynamo_orig_callable", None) is not None)


def install(session: Any) -> None:
    original = torch.compile
    if getattr(original, _ORIG, None) is not None:
        return

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda m: compile(m, **kwargs)
        try:
            session.scan_main()  # a --step function of __main__ exists by now
        except Exception:  # noqa: BLE001
            pass
        step_fn = getattr(model, "__replay_step_fn__", None)
        owner = _module_of(model)
        try:
            _remember(step_fn or owner or model, kwargs)
        except Exception:  # noqa: BLE001 - only the record of the arguments is lost
            pass
        if step_fn is not None:
            # Our step wrapper: compile what it wraps, record around the compiled result.
            compiled = original(step_fn, **kwargs)
            try:
                return session.boundary(step_fn, compiled, spec=getattr(model, "__replay_spec__", None))
            except Exception:  # noqa: BLE001
                return compiled
        compiled = original(model, **kwargs)
        if owner is not None:
            # A module's own call compiled: the step is the module's, recorded around the
            # compiled call with the module as its object (state, weights, class name).
            try:
                return session.module_boundary(owner, compiled)
            except Exception:  # noqa: BLE001
                return compiled
        if isinstance(model, torch.nn.Module):
            # An OptimizedModule calls its instance attribute ``forward`` (the compiled call):
            # that attribute is wrapped, so the step is recorded around the compiled forward,
            # with the original module as its object (its state, weights, class name).
            try:
                fwd = compiled.__dict__.get("forward")
                if fwd is not None and not getattr(fwd, BOUNDARY, False):
                    compiled.__dict__["forward"] = session.module_boundary(model, fwd)
            except Exception:  # noqa: BLE001
                pass
            return compiled
        if not callable(compiled) or not callable(model):
            return compiled
        try:
            return session.boundary(model, compiled)
        except Exception:  # noqa: BLE001 - the program gets what torch gave it
            return compiled

    setattr(compile, _ORIG, original)
    torch.compile = compile  # type: ignore[assignment]
    import warnings

    warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
