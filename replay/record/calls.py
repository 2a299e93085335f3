"""Calls to the callables replay wraps: which arguments are inputs, what the outputs are named,
and how a graph key is read off a capture call. Shared by recording and re-running."""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

import torch

from replay.core.outputs import name_outputs  # noqa: F401 - the vocabulary moved below record and rerun
from replay.core.state import module_state  # noqa: F401
from replay.core.structure import (POSITIONAL_ARG, STRUCTURE_ARG, flatten_object, flatten_tensors,  # noqa: F401 - shared with rerun
                                   positional_names, rebuild_inputs, unrecordable)

__all__ = ["argument_pairs", "to_json_safe", "config_settings", "module_state", "split_arguments", "flatten_tensors", "flatten_object", "unrecordable", "rebuild_inputs", "STRUCTURE_ARG", "name_outputs", "Binder", "access", "attribute_holding", "call_key", "weakrefable", "capturing", "cuda_capturing", "tracing"]

_SCALARS = (int, float, bool, str, type(None))


def _jsonable(v: Any) -> Any:
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v):
        return list(v)
    if isinstance(v, torch.dtype):
        return {"dtype": str(v)}
    return {"unrecorded": type(v).__name__, "object": _OBJECTS.ordinal(v)}


class _ObjectOrdinals:
    """A number for each object recorded by class name only, in the order the process first
    passed one to a step: a re-run tells the steps that took one cache object from those that
    took the next (a second ``generate()`` makes a new ``DynamicCache``). Weak: a cache the
    program drops is not kept alive by the recorder."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, int]] = {}
        self._next = 0
        self._lock = threading.Lock()

    def ordinal(self, v: Any) -> int:
        key = id(v)
        with self._lock:
            got = self._seen.get(key)
            if got is not None and (got[0] is None or got[0]() is v):
                return got[1]
            try:
                ref = weakref.ref(v, lambda _r, key=key: self._seen.pop(key, None))
            except TypeError:
                ref = None  # not weak-referenceable: known by its id
            n = self._next
            self._next += 1
            self._seen[key] = (ref, n)
            return n


_OBJECTS = _ObjectOrdinals()


class NotJSON(TypeError):
    """A value ``to_json_safe`` cannot turn into JSON (a tensor, a model, an open file, ...)."""


def _json_leaf(v: Any) -> tuple[bool, Any]:
    """(True, JSON) for the leaves of a config (scalars, enums, dtypes, devices, paths)."""
    import enum
    import os

    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return True, v
    if isinstance(v, float):
        return True, (v if v == v and v not in (float("inf"), float("-inf")) else str(v))
    if isinstance(v, (torch.dtype, torch.device)):
        return True, str(v)
    if isinstance(v, os.PathLike):
        return True, os.fspath(v)
    if isinstance(v, enum.Enum):
        return False, v.value
    return False, None


def _json_fields(v: Any) -> dict[Any, Any] | list[Any] | None:
    """The fields of a config container (dataclass, namespace, dict, sequence, set, namedtuple)."""
    import dataclasses
    import types

    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
    if isinstance(v, types.SimpleNamespace) or type(v).__name__ == "Namespace":
        return dict(vars(v))
    if hasattr(v, "_asdict") and isinstance(v, tuple):
        return dict(v._asdict())
    if isinstance(v, dict):
        return v
    if isinstance(v, (set, frozenset)):
        return sorted(v, key=repr)
    if isinstance(v, (list, tuple)):
        return list(v)
    return None


def config_settings(v: Any) -> dict[str, Any]:
    """A dataclass config's instance attributes that are not among its fields, when they are
    plain values: settings a library keeps beside the fields it declares (HF's
    ``_attn_implementation_internal``, eager or sdpa, which changes what attention computes)
    and leaves out of the config. Kept apart from the config itself, which a factory is given."""
    import dataclasses

    if not dataclasses.is_dataclass(v) or isinstance(v, type):
        return {}
    try:
        attrs = vars(v)
    except TypeError:
        return {}  # slots only: nothing beside the fields
    declared = {f.name for f in dataclasses.fields(v)}
    out = {}
    for k, x in attrs.items():
        leaf, value = _json_leaf(x)
        if k not in declared and leaf and isinstance(k, str):
            out[k] = value
    return out


def to_json_safe(v: Any, _depth: int = 0) -> Any:
    """A config as JSON: dataclasses and namespaces as dicts of their fields, enums by value,
    paths, dtypes and devices as strings, tuples and sets as lists. Raises ``NotJSON`` for
    anything else (a tensor, a module): a config is data, not objects."""
    import enum

    if _depth > 32:
        raise NotJSON("nested more than 32 levels deep")
    leaf, value = _json_leaf(v)
    if leaf:
        return value
    if isinstance(v, enum.Enum):
        return to_json_safe(value, _depth + 1)
    fields = _json_fields(v)
    if isinstance(fields, dict):
        return {str(k.value if isinstance(k, enum.Enum) else k): to_json_safe(x, _depth + 1) for k, x in fields.items()}
    if isinstance(fields, list):
        return [to_json_safe(x, _depth + 1) for x in fields]
    raise NotJSON(f"a {type(v).__name__} is not JSON data")


def without_parameters(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` without the tensors that are ``module``'s parameters (by identity or storage)."""
    params = {id(p) for p in module.parameters()}
    ptrs = set()
    for p in module.parameters():
        try:
            ptrs.add(p.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001
            pass
    kept, dropped = {}, []
    for k, t in state.items():
        try:
            same = id(t) in params or (t.untyped_storage().data_ptr() in ptrs and t.numel() > 0)
        except Exception:  # noqa: BLE001
            same = id(t) in params
        if same:
            dropped.append(k)
        else:
            kept[k] = t
    return kept, dropped


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


class Binder:
    """``signature.bind(*args, **kwargs)`` for the calls of one step, planned once per call shape.

    A step is called the same way every time (so many positional arguments, these keywords),
    and ``inspect.Signature.bind`` re-derives the same answer each call: ~20 µs when it runs right
    after the program's own work. For a signature of plain parameters (no ``*args``,
    ``**kwargs``, positional- or keyword-only ones) the first call of each shape is bound by
    ``inspect`` (and raises the program's own ``TypeError`` as it does); later calls of that
    shape only pair names with values. Anything else is bound by ``inspect`` every time."""

    __slots__ = ("signature", "_names", "_plans")

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
        self._names = tuple(signature.parameters) if plain else None
        self._plans: dict[tuple, tuple[tuple[str, int | str], ...]] = {}

    def bind(self, /, *args: Any, **kwargs: Any) -> inspect.BoundArguments:  # a step may take ``self=`` by keyword
        names = self._names
        if names is None:
            return self.signature.bind(*args, **kwargs)
        key = (len(args), *kwargs)
        plan = self._plans.get(key)
        if plan is None:
            bound = self.signature.bind(*args, **kwargs)  # the program's own TypeError, if any
            if len(self._plans) < 64:
                # Each name's source, in the signature's order (as ``bind`` orders them).
                self._plans[key] = tuple((n, i if i < len(args) else n) for i, n in enumerate(names)
                                         if i < len(args) or n in kwargs)
            return bound
        arguments = {n: args[src] if src.__class__ is int else kwargs[src] for n, src in plan}
        return inspect.BoundArguments(self.signature, arguments)  # type: ignore[arg-type]


# Signatures of plain parameters only (no ``*args``, ``**kwargs``, positional- or keyword-only
# ones), by ``id`` with the signature kept: their arguments are their bound items, and none is
# passed by position only (a step's call is split each step, right after the program's work).
_PLAIN_SIGNATURES: dict[int, tuple[inspect.Signature, bool]] = {}


def plain_signature(sig: inspect.Signature) -> bool:
    known = _PLAIN_SIGNATURES.get(id(sig))
    if known is not None and known[0] is sig:
        return known[1]
    plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    if len(_PLAIN_SIGNATURES) >= 256:
        _PLAIN_SIGNATURES.clear()
    _PLAIN_SIGNATURES[id(sig)] = (sig, plain)
    return plain


def argument_pairs(bound: inspect.BoundArguments, skip_first: bool) -> list[tuple[str, Any]]:
    """(name, value) of every argument, ``*args`` as ``name.i`` and ``**kwargs`` by key."""
    items = list(bound.arguments.items())
    if skip_first and items:
        items = items[1:]
    if plain_signature(bound.signature):
        return items
    params = bound.signature.parameters
    pairs: list[tuple[str, Any]] = []
    for name, value in items:
        kind = params[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD and isinstance(value, dict):
            pairs += list(value.items())
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            pairs += [(f"{name}.{i}", v) for i, v in enumerate(value)]
        else:
            pairs.append((name, value))
    return pairs


def _plain_container(v: Any, found: tuple[dict[str, torch.Tensor], Any]) -> bool:
    """A flat list or str-keyed dict of tensors only: recorded without a structure (as before).
    A dict of its own class (an HF ``ModelOutput``) keeps its structure, which names the class."""
    _, structure = found
    items = structure.get("items", []) if isinstance(structure, dict) else []
    return type(v) in (list, dict) and all(s == "tensor" for s in items) and not structure.get("indexed")


def _any_unrecordable(tensors: dict[str, torch.Tensor]) -> str | None:
    for t in tensors.values():
        why = unrecordable(t)
        if why is not None:
            return why
    return None


def split_arguments(
    bound: inspect.BoundArguments, skip_first: bool, owner: Any = None, target_arg: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A step's arguments: tensors (recorded as inputs) and the rest (recorded as JSON).

    Containers of tensors are flattened to ``name.i`` inputs (nested ones, tuples and ``None``
    holes with their shape under ``__structure__``, see ``rebuild_inputs``). An object that is
    an attribute of ``owner`` (the step's object) is recorded as ``{"attr": name}``;
    ``target_arg`` (the step's object when it is an argument of a function step) as
    ``{"target": true}``; anything else as ``{"unrecorded": type}``, and so is a tensor whose
    values cannot be recorded, or a container or object holding one (``unrecordable``). The arguments a re-run
    must pass by position (``*args``'s items, positional-only ones) are named, in order, under
    ``__positional__``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    structures: dict[str, Any] = {}
    for n, v in argument_pairs(bound, skip_first):
        if isinstance(v, torch.Tensor):
            why = unrecordable(v)
            if why is None:
                tensors[n] = v
            else:
                scalars[n] = {"unrecorded": why}
            continue
        found = flatten_tensors(n, v, values=True) if isinstance(v, (list, tuple, dict)) else None
        if found is not None and (why := _any_unrecordable(found[0])) is not None:
            scalars[n] = {"unrecorded": f"{type(v).__name__} holding a {why}"}
        elif found is not None:
            tensors.update(found[0])
            if not _plain_container(v, found):
                structures[n] = found[1]
        elif target_arg is not None and v is target_arg:
            # The step's object passed as an argument (``decode_one_token(model, ...)``):
            # a re-run passes the object it rebuilt.
            scalars[n] = {"target": True, "type": type(v).__name__}
        elif (attr := attribute_holding(owner, v) if not isinstance(v, (list, tuple, dict, torch.dtype)) else None):
            scalars[n] = {"attr": attr, "type": type(v).__name__}
        elif isinstance(v, torch.Generator):
            # A generator the step draws from (``torch.multinomial(p, 1, generator=g)``): its
            # state before the call, so that a re-run draws the same numbers.
            tensors[n] = v.get_state()
            scalars[n] = {"generator": str(v.device)}
        elif (obj := flatten_object(n, v)) is not None and (why := _any_unrecordable(obj[0])) is not None:
            scalars[n] = {"unrecorded": f"{type(v).__name__} holding a {why}", "object": _OBJECTS.ordinal(v)}
        elif obj is not None:
            # A data object (``step(batch)``): its tensors as inputs, its shape and scalars as structure.
            tensors.update(obj[0])
            structures[n] = obj[1]
        else:
            scalars[n] = _jsonable(v)
    if structures:
        scalars[STRUCTURE_ARG] = structures
    positional = [] if plain_signature(bound.signature) else positional_names(bound, skip_first)
    if positional:
        scalars[POSITIONAL_ARG] = positional
    return tensors, scalars


def access(obj: Any, name: str | None) -> Any:
    """``obj.name``, called if it is a method; None when there is no such thing."""
    if obj is None or not name:
        return None
    attr = obj
    for part in name.split("."):
        attr = getattr(attr, part)
    return attr() if callable(attr) and not isinstance(attr, torch.nn.Module) else attr


def tracing() -> bool:
    """A graph is being built from Python calls (``torch.jit.trace``, ``torch.fx`` symbolic
    tracing): a call now is the tracer's, and anything the recorder did would be traced into
    the program's graph. Also inside a ``torch.func`` transform (``vmap``, ``grad``): its
    tensors are wrappers with no storage, and the call is one of the transform's."""
    if torch._C._get_tracing_state() is not None:
        return True
    if _functorch_level is not None and _functorch_level() is not None:
        return True
    return bool(_fx_tracing is not None and _fx_tracing())


_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)


def _fx_tracer() -> Any:
    # ``is_fx_tracing`` also answers for torch.export and logs a warning saying so: the one for
    # symbolic tracing alone says nothing.
    try:
        from torch.fx import _symbolic_trace as st
    except ImportError:  # pragma: no cover - a torch without it
        return None
    fn = getattr(st, "is_fx_symbolic_tracing", None)
    if fn is not None:
        return fn
    # Older torch: the flag itself (is_fx_tracing() would log a warning into the program's output).
    return lambda: bool(getattr(st, "_is_fx_tracing_flag", False))


_fx_tracing = _fx_tracer()


# The C function under ``torch.cuda.is_current_stream_capturing`` (one Python frame less, on
# the path before every recorded step is queued).
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def cuda_capturing() -> bool:
    """The current CUDA stream is capturing a graph (the recorder must queue nothing on it)."""
    # is_initialized first: it is a flag, and no stream captures before CUDA is initialised.
    return torch.cuda.is_initialized() and _stream_capturing()


def capturing() -> bool:
    """A CUDA graph is being captured, or a tracer is building a graph: not a step to record."""
    return tracing() or cuda_capturing()


def call_key(sig: inspect.Signature | Binder, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """A graph key from a capture/replay call's scalar arguments: ("bucket=4", (4,)).

    With a ``Binder`` (a replay, called every step), a call of a known shape is bound without
    ``inspect``; a call ``bind`` refuses is bound partially, as with a signature."""
    try:
        if isinstance(sig, Binder):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                bound = sig.signature.bind_partial(*args, **kwargs)
        else:
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
