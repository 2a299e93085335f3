"""Calls to the callables replay wraps: which arguments are inputs, what the outputs are named,
and how a graph key is read off a capture call. Shared by recording and re-running."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

__all__ = ["split_arguments", "name_outputs", "access", "attribute_holding", "call_key", "weakrefable", "capturing"]

_SCALARS = (int, float, bool, str, type(None))


def _jsonable(v: Any) -> Any:
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v):
        return list(v)
    if isinstance(v, torch.dtype):
        return {"dtype": str(v)}
    return {"unrecorded": type(v).__name__}


def attribute_holding(owner: Any, value: Any) -> str | None:
    """The name of ``owner``'s attribute that is ``value`` itself (the same object), if any.

    A step called with an object its own engine holds (a KV cache passed as
    ``decode_step(ids, pos, self.cache)``) cannot be recorded as data, but it can be recorded as
    that attribute: a re-run passes the rebuilt engine's attribute of the same name."""
    if owner is None or isinstance(value, _SCALARS):
        return None
    try:
        items = list(vars(owner).items())
    except TypeError:
        return None
    for name, attr in items:
        if attr is value and not name.startswith("__"):
            return name
    return None


def split_arguments(
    bound: inspect.BoundArguments, skip_first: bool, owner: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A step's arguments: tensors (recorded as inputs) and the rest (recorded as JSON).

    An object that is an attribute of ``owner`` (the step's object) is recorded as
    ``{"attr": name}``; one that is neither JSON nor such an attribute as ``{"unrecorded": type}``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    items = list(bound.arguments.items())
    if skip_first and items:
        items = items[1:]
    params = bound.signature.parameters
    for name, value in items:
        kind = params[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD and isinstance(value, dict):
            pairs = list(value.items())
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            pairs = [(f"{name}.{i}", v) for i, v in enumerate(value)]
        else:
            pairs = [(name, value)]
        for n, v in pairs:
            if isinstance(v, torch.Tensor):
                tensors[n] = v
            elif isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
                for i, x in enumerate(v):
                    tensors[f"{n}.{i}"] = x
            elif isinstance(v, dict) and v and all(isinstance(x, torch.Tensor) for x in v.values()):
                for k, x in v.items():
                    tensors[f"{n}.{k}"] = x
            else:
                attr = attribute_holding(owner, v) if not isinstance(v, (list, tuple, dict, torch.dtype)) else None
                scalars[n] = {"attr": attr, "type": type(v).__name__} if attr else _jsonable(v)
    return tensors, scalars


def name_outputs(out: Any, names: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """Tensors a step returned, by name: NamedTuple/dataclass fields, dict keys, or given names."""
    if isinstance(out, torch.Tensor):
        if names:
            return {names[0]: out}
        # A lone floating output with a vocabulary-like last dimension is what a step's logits
        # look like; naming it so gives the margin and the logits ring without configuration.
        return {"logits" if out.is_floating_point() and out.dim() >= 2 else "output": out}
    pairs: list[tuple[str, Any]]
    if isinstance(out, dict):
        pairs = [(str(k), v) for k, v in out.items()]
    elif hasattr(out, "_fields"):
        pairs = list(zip(out._fields, out))
    elif hasattr(out, "__dataclass_fields__"):
        pairs = [(k, getattr(out, k)) for k in out.__dataclass_fields__]
    elif isinstance(out, (list, tuple)):
        pairs = [(names[i] if i < len(names) else f"out{i}", v) for i, v in enumerate(out)]
    else:
        return {}
    return {k: v for k, v in pairs if isinstance(v, torch.Tensor)}


def access(obj: Any, name: str | None) -> Any:
    """``obj.name``, called if it is a method; None when there is no such thing."""
    if obj is None or not name:
        return None
    attr = obj
    for part in name.split("."):
        attr = getattr(attr, part)
    return attr() if callable(attr) and not isinstance(attr, torch.nn.Module) else attr


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def call_key(sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """A graph key from a capture/replay call's scalar arguments: ("bucket=4", (4,))."""
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return "graph", ()
    items = list(bound.arguments.items())
    if items and items[0][0] in ("self", "cls"):
        items = items[1:]
    scal = [(k, v) for k, v in items if isinstance(v, (int, str)) and not isinstance(v, bool)]
    ints = tuple(v for _, v in scal if isinstance(v, int))
    return ",".join(f"{k}={v}" for k, v in scal) or "graph", ints


def weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False
