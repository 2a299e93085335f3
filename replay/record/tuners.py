"""Tuner choices: Triton's autotuner caches (the engine's own tuner is read through its profile)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["install_triton"]


def install_triton(session: Any, module: Any) -> None:
    """Track every ``triton.runtime.autotuner.Autotuner`` and report its cached winners."""
    cls = getattr(module, "Autotuner", None)
    if cls is None or getattr(cls, "__replay_patched__", False):
        return
    instances: weakref.WeakSet[Any] = weakref.WeakSet()
    orig_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        instances.add(self)

    def choices() -> dict[str, str]:
        out = {}
        for tuner in list(instances):
            fn = getattr(getattr(tuner, "fn", None), "__name__", None) or getattr(tuner, "base_fn", None)
            name = getattr(fn, "__name__", str(fn))
            for key, config in getattr(tuner, "cache", {}).items():
                out[f"triton:{name}{list(key) if isinstance(key, tuple) else key}"] = str(config)
        return out

    cls.__init__ = __init__
    cls.__replay_patched__ = True
    session.add_tuner_source(choices)
