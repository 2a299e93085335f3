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

__all__ = ["install", "BOUNDARY", "is_compiled_callable"]

BOUNDARY = "__replay_boundary__"
_ORIG = "__replay_original__"


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
        if step_fn is not None:
            # Our step wrapper: compile what it wraps, record around the compiled result.
            compiled = original(step_fn, **kwargs)
            try:
                return session.boundary(step_fn, compiled, spec=getattr(model, "__replay_spec__", None))
            except Exception:  # noqa: BLE001
                return compiled
        compiled = original(model, **kwargs)
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
