"""Whether an object a step takes by class name only (a second model, a cache object) changed
while the program was recorded.

``replay record`` warns that what the program changes in such an object between steps is not
reproduced by a re-run. For a frozen model passed beside the step's own (a speculative decoder's
target) that warning is false; a fingerprint taken at the step's first call and again at the end
says which objects did not change, and the summary says nothing of those. The fingerprint is
cheap and conservative: tensors by identity and version counter (an in-place write bumps it),
plain attributes by value, other attributes by identity, containers (attributes, or the argument
itself: a paged cache's block table passed as a dict of lists) by identity, length and what they
hold, read the same way. Anything it cannot read, or too much to read, counts as changed.

It is taken once per step name at the step's first call and read once more when the process
ends, never at every step; ``_MAX_VALUES`` bounds each reading.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Fingerprint"]

_SCALARS = (int, float, bool, str, bytes, type(None))
_MAX_ITEMS = 4096  # a container larger than this counts as changed (not walked)
_MAX_OBJECTS = 2048  # modules and objects walked per argument
_MAX_VALUES = 32 * _MAX_ITEMS  # values read per argument, those inside nested containers included


class _Walk:
    """The objects reachable from one argument through attributes, modules and containers."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.todo: list[Any] = []
        # Everything named by its id() stays alive with the fingerprint, so that no later object
        # can take a freed one's id (a state tensor replaced each step, at a reused address).
        self.held: list[Any] = []
        self.budget = _MAX_VALUES

    def value(self, v: Any) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise ValueError("too many values to read")
        if isinstance(v, torch.Tensor):
            self.held.append(v)
            return ("t", id(v), v._version, tuple(v.shape), v.dtype)
        if isinstance(v, _SCALARS):
            return ("v", v)
        if isinstance(v, (list, tuple, dict)):
            if len(v) > _MAX_ITEMS:
                raise ValueError("a container too large to walk")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            self.held.append(v)
            return ("c", id(v), len(v), tuple((k if isinstance(k, _SCALARS) else self.value(k), self.value(x)) for k, x in items))
        if isinstance(getattr(v, "__dict__", None), dict):
            self.todo.append(v)  # its own state is walked too
        self.held.append(v)
        return ("o", id(v))

    def state(self, obj: Any) -> tuple:
        out: list[Any] = []
        if isinstance(obj, (list, tuple, dict)):
            # A container passed as the argument has no attributes of its own: what it holds is its state.
            out.append(("", self.value(obj)))
        self.todo.append(obj)
        while self.todo:
            o = self.todo.pop()
            if id(o) in self.seen:
                continue
            self.seen.add(id(o))
            if len(self.seen) > _MAX_OBJECTS:
                raise ValueError("too many objects to walk")
            if isinstance(o, torch.nn.Module):
                out += [(n, self.value(t)) for n, t in o._parameters.items()]
                out += [(n, self.value(t)) for n, t in o._buffers.items()]
                self.todo += [m for m in o._modules.values() if m is not None]
            d = getattr(o, "__dict__", None)
            for k, v in (d.items() if isinstance(d, dict) else ()):
                if k in ("_parameters", "_buffers", "_modules") or (k.startswith("_") and k.endswith("hooks")):
                    continue
                out.append((k, self.value(v)))
        return tuple(out)


class Fingerprint:
    """An argument's state as far as it can be told cheaply, taken now; ``same_now()`` compares
    it with the state the object is in then. One that could not be read, or that the program
    replaced by another object at a later call (``changed``), is never the same."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.obj = obj
        self.changed = False  # set by the caller: another object was passed in its place
        try:
            walk = _Walk()
            self._state: tuple | None = walk.state(obj)
            self._held = walk.held
        except Exception:  # noqa: BLE001 - an object that refuses to be read counts as changed
            self._state, self._held = None, []

    def same_now(self) -> bool:
        if self._state is None or self.changed:
            return False
        try:
            return _Walk().state(self.obj) == self._state
        except Exception:  # noqa: BLE001
            return False
