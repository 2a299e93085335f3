"""Naming the models of one loop (draft and target, MTP head and trunk): each is a stream."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["stream_name"]

_SKIP = ("self", "obj", "module", "m", "args", "kwargs", "value", "v", "x")


def stream_name(obj: Any, taken: set[str]) -> str:
    """A name for ``obj``'s stream: the name the outermost caller's variable gives it (``draft``
    in ``main()``, rather than the ``model`` parameter of the step function every model passes
    through), else its class name; unique among ``taken``."""
    base = None
    if obj is not None:
        f = sys._getframe(1)
        for _ in range(200):
            if f is None:
                break
            if not f.f_code.co_filename.startswith(_OWN):
                for k, v in f.f_locals.items():
                    if _holds(v, obj) and k not in _SKIP and not k.startswith("_"):
                        base = k  # keep going: an outer frame's name wins
                        break
            f = f.f_back
    if base is None:
        base = type(obj).__name__ if obj is not None else "stream"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}{i}", i + 1
    return name


def _holds(v: Any, obj: Any) -> bool:
    """``v`` is ``obj``, or the compiled module made of it (``target = torch.compile(target)``)."""
    if v is obj:
        return True
    return type(v).__name__ == "OptimizedModule" and getattr(v, "_orig_mod", None) is obj


def _own_dir() -> str:
    import os

    import replay

    return os.path.dirname(os.path.abspath(replay.__file__))


_OWN = _own_dir()
