"""Nested containers of tensors as step arguments (an HF ``past_key_values``): flattened to
named inputs when recorded, rebuilt with their types and ``None`` holes when re-run. Shared by
``record`` and ``rerun``, below both."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from typing import Any, Callable

import torch

# The reserved keys of a step's recorded arguments live in a module without torch: ``info`` reads them.
from replay.core.argnames import POSITIONAL_ARG, STRUCTURE_ARG, UNRECORDED_ARG

__all__ = ["STRUCTURE_ARG", "POSITIONAL_ARG", "UNRECORDED_ARG", "MAX_OBJECT_BYTES", "RecordedDict", "unrecordable", "flatten_tensors", "flatten_object", "rebuild_inputs",
           "RecordedObject", "object_fields", "positional_names", "call_arguments"]

_MAX_NESTED = 1 << 16
# Python values kept beside a step's tensors in one argument (request ids, temperatures): more
# than this (a list of a prompt's token ids) would go into every step's record as JSON.
_MAX_VALUES = 256


def unrecordable(t: torch.Tensor) -> str | None:
    """What kind of tensor ``t`` is when its values are not a dense array of bytes the recorder
    can copy and a re-run can rebuild (a sparse, nested or quantized tensor, or one on the meta
    device); None for every other. Such an argument is recorded by its kind only, as an object
    is, and recording goes on."""
    if t.is_nested:
        return "nested tensor"
    if t.layout is not torch.strided:
        return f"{str(t.layout).rpartition('.')[2]} tensor"
    if t.is_quantized:
        return "quantized tensor"
    if t.is_meta:
        return "meta tensor"
    return None


def flatten_tensors(name: str, v: Any, *, values: bool = False, empty: bool = False) -> tuple[dict[str, torch.Tensor], Any] | None:
    """A container of tensors (lists, tuples, dicts, nested, with ``None`` holes: an HF
    ``past_key_values``) as ``{name.i.j: tensor}`` and its structure for ``rebuild_inputs``;
    None when ``v`` is not such a container (no tensor in it, or anything else inside).
    ``values``: numbers, strings and booleans beside the tensors are kept in the structure (a
    step's ``batch`` dict with its request ids and temperature); ``empty``: a container of such
    values alone is one too (a data object's ``request_ids`` list beside its tensor fields)."""
    out: dict[str, torch.Tensor] = {}
    leaves = [0]

    def walk(prefix: str, x: Any, depth: int) -> Any:
        if isinstance(x, torch.Tensor):
            out[prefix] = x
            return "tensor"
        if x is None:
            return None
        if values and isinstance(x, _JSON_LEAVES) and not (isinstance(x, float) and x != x):
            leaves[0] += 1
            if leaves[0] > _MAX_VALUES:
                raise ValueError("too many values")  # a prompt's token ids as a list: not into every step's record
            return {"type": "value", "value": x}
        if depth > 8 or len(out) > _MAX_NESTED:
            raise ValueError("too deep")
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return {"type": "tuple" if isinstance(x, tuple) else "list", "items": [walk(f"{prefix}.{i}", y, depth + 1) for i, y in enumerate(x)]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return _dict_structure(x, lambda i, k, y: walk(f"{prefix}.{i if i is not None else k}", y, depth + 1))
        raise ValueError("not a tensor container")

    try:
        structure = walk(name, v, 0)
    except ValueError:
        return None
    return (out, structure) if out or (empty and structure is not None) else None


def _class_name(klass: type) -> str:
    """How a recorded structure names a class (``module:qualname``), to match the program's own."""
    return f"{klass.__module__}:{klass.__qualname__}"


def _dict_structure(x: dict[str, Any], walk: Callable[[int | None, str, Any], Any]) -> dict[str, Any]:
    """A str-keyed dict's structure; ``walk(place, key, item)`` the items' (named by key, or by
    ``place`` when keys hold a dot)."""
    # Keys holding a dot (``dict(model.named_parameters())`` for ``functional_call``) would run
    # into the dotted names: their items are named by place instead.
    indexed = any("." in k for k in x)
    spec: dict[str, Any] = {"type": "dict", "keys": list(x),
                            "items": [walk(i if indexed else None, k, y) for i, (k, y) in enumerate(x.items())]}
    if indexed:
        spec["indexed"] = True
        # A model's parameters by name (``functional_call(model, params, ...)``) are its weights,
        # not a step's input: past the data-object bound it is left as it was (recorded by class
        # name), rather than copying the weights at every step.
        if sum(t.numel() * t.element_size() for t in x.values() if isinstance(t, torch.Tensor)) > MAX_OBJECT_BYTES:
            raise ValueError("a dict of parameters")
    if type(x) is not dict:
        # A dict of its own class (an HF ModelOutput, read by place as ``out[0]``): named, so that
        # a re-run can give the step the program's own class back (``as_instance``).
        spec["class"] = _class_name(type(x))
    return spec


_MAX_FIELDS = 64
# A data object's tensors are recorded with every step: an object holding more than this (a KV
# cache object the loop passes in) is left as it was, an argument the recording names but does
# not keep, rather than copying a cache a step.
MAX_OBJECT_BYTES = 16 << 20
_JSON_LEAVES = (int, float, bool, str, type(None))


_PLAIN_CLASSES: dict[type, bool] = {}


def _plain_class(klass: type) -> bool:
    """A class of data only: no public methods (a cache object with ``update`` is not data: a
    re-run could not give it back its behaviour from the recorded fields)."""
    plain = _PLAIN_CLASSES.get(klass)
    if plain is None:
        try:
            plain = not any(callable(getattr(klass, n, None)) for n in dir(klass) if not n.startswith("_"))
        except Exception:  # noqa: BLE001
            plain = False
        if len(_PLAIN_CLASSES) < 1024:
            _PLAIN_CLASSES[klass] = plain
    return plain


def object_fields(v: Any) -> dict[str, Any] | None:
    """The fields of a data object (a dataclass, a NamedTuple, a namespace, an instance of a
    class with no public methods): what a step taking ``step(batch)`` reads. None for anything
    else (a module, a class, a function, a tensor, a container, an object with behaviour)."""
    if isinstance(v, (*_JSON_LEAVES, bytes, torch.Tensor, torch.nn.Module, type, list, dict, torch.dtype, torch.device)) \
            or callable(v):
        return None
    if isinstance(v, tuple):
        return dict(v._asdict()) if hasattr(v, "_asdict") else None
    if dataclasses.is_dataclass(v):
        return {f.name: getattr(v, f.name, None) for f in dataclasses.fields(v)}
    if not isinstance(v, types.SimpleNamespace) and not _plain_class(type(v)):
        return None
    try:
        return {k: x for k, x in vars(v).items() if not k.startswith("__")}
    except TypeError:
        return None


def flatten_object(name: str, v: Any) -> tuple[dict[str, torch.Tensor], Any] | None:
    """A data object holding tensors (``step(batch)`` with ``batch.ids``, ``batch.positions``)
    as ``{name.field: tensor}`` and its structure: the fields that are tensors or containers of
    them, and the JSON scalars beside them. None when ``v`` is no such object (no tensor in it,
    or a field of anything else: a model, a file)."""
    fields = object_fields(v)
    if not fields or len(fields) > _MAX_FIELDS:
        return None
    out: dict[str, torch.Tensor] = {}
    keys, items = [], []
    for k, x in fields.items():
        if not isinstance(k, str) or "." in k:
            return None
        if isinstance(x, torch.Tensor):
            out[f"{name}.{k}"] = x
            spec: Any = "tensor"
        elif isinstance(x, _JSON_LEAVES) and not (isinstance(x, float) and x != x):
            spec = {"type": "value", "value": x}
        else:
            found = flatten_tensors(f"{name}.{k}", x, values=True, empty=True) if isinstance(x, (list, tuple, dict)) else None
            if found is None:
                return None
            out.update(found[0])
            spec = found[1]
        keys.append(k)
        items.append(spec)
    if not out or sum(t.numel() * t.element_size() for t in out.values()) > MAX_OBJECT_BYTES:
        return None
    return out, {"type": "object", "class": _class_name(type(v)), "keys": keys, "items": items}


class RecordedDict(dict):
    """A step's argument recorded as a dict of its own class (an HF ``ModelOutput``: read by key,
    attribute and place): the recorded items; ``as_instance`` gives them the program's class."""

    def __init__(self, class_name: str, items: dict[str, Any]) -> None:
        super().__init__(items)
        self.__replay_class__ = class_name

    def as_instance(self, like: Any) -> Any:
        """These items in a copy of ``like`` when it is of the recorded class; else self."""
        if _class_name(type(like)) != self.__replay_class__ or not isinstance(like, dict):
            return self
        try:
            obj = copy.copy(like)
            if any(k not in self for k in obj):
                return self  # the program's object holds what the recorded one did not
            for k, v in self.items():
                obj[k] = v  # a ModelOutput's __setitem__ sets its attribute too
        except Exception:  # noqa: BLE001 - a class that refuses: the recorded items as a dict
            return self
        return obj


class RecordedObject(types.SimpleNamespace):
    """A step's data-object argument rebuilt from the recording: its fields as attributes. The
    re-run makes it an instance of the program's own class where it has one (``as_instance``);
    elsewhere the step reads its fields from this."""

    def __init__(self, class_name: str, fields: dict[str, Any]) -> None:
        super().__init__(**fields)
        object.__setattr__(self, "__replay_class__", class_name)

    def as_instance(self, like: Any) -> Any:
        """These fields in an instance of ``like``'s class (a copy of ``like``), when that is
        the recorded class; else self."""
        if _class_name(type(like)) != getattr(self, "__replay_class__", None):
            return self
        fields = {k: v for k, v in vars(self).items() if k != "__replay_class__"}
        if isinstance(like, tuple) and hasattr(like, "_replace"):
            return like._replace(**fields)
        obj = copy.copy(like)
        for k, v in fields.items():
            object.__setattr__(obj, k, v)  # a frozen dataclass too
        return obj


def positional_names(bound: inspect.BoundArguments, skip_first: bool = False) -> list[str]:
    """The recorded names of a call's arguments that a re-run must pass by position, in order:
    positional-only parameters and, when the call filled ``*args``, every parameter before it
    and ``*args``'s items (``args.0``, ``args.1``, ... as ``split_arguments`` names them).
    Empty for a call that keywords repeat (the usual one). ``skip_first``: the method's object."""
    params = bound.signature.parameters
    items = list(bound.arguments.items())[1 if skip_first else 0:]
    filled = any(params[n].kind is inspect.Parameter.VAR_POSITIONAL and v for n, v in items)
    names: list[str] = []
    for n, v in items:
        kind = params[n].kind
        if kind is inspect.Parameter.POSITIONAL_ONLY or (filled and kind is inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(n)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            names += [f"{n}.{i}" for i in range(len(v))]
    return names


def call_arguments(values: dict[str, Any], positional: Any) -> tuple[list[Any], dict[str, Any]]:
    """A recorded step's arguments (``values``, by recorded name) as the call made them: those
    named by ``positional`` (the recorded ``__positional__``), in order, and the rest by keyword."""
    if not isinstance(positional, list) or not positional:
        return [], values
    kwargs = dict(values)
    missing = [n for n in positional if not isinstance(n, str) or n not in kwargs]
    if missing:
        raise KeyError(f"recorded positional argument(s) {', '.join(map(str, missing))} not recorded")
    return [kwargs.pop(n) for n in positional], kwargs


def _argument_of(key: str, dotted: tuple[str, ...]) -> tuple[str, str]:
    """(argument, rest) of an input's recorded name: ``cache.0`` -> (cache, 0); with ``args.2``
    an argument of its own (an ``*args`` item), ``args.2.0`` -> (args.2, 0)."""
    for n in dotted:
        if key == n or key.startswith(n + "."):
            return n, key[len(n) + 1:]
    base, _, sub = key.partition(".")
    return base, sub


def rebuild_inputs(inputs: dict[str, torch.Tensor], structures: dict[str, Any] | None = None,
                   positional: Any = None) -> dict[str, Any]:
    """Inverse of ``split_arguments``'s flattening: ``{name: tensor or container}``.

    ``structures`` (the recorded ``__structure__`` argument) gives nested containers their
    types and ``None`` holes; without it, one level: digit keys make a list, others a dict.
    ``positional`` (the recorded ``__positional__``): arguments whose names hold a dot
    (``*args`` items, ``args.0``) are arguments of their own, not items of a container ``args``."""
    structures = structures or {}
    dotted = tuple(sorted((n for n in positional or () if isinstance(n, str) and "." in n), key=len, reverse=True))
    out: dict[str, Any] = {}
    flat: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in inputs.items():
        base, sub = _argument_of(k, dotted)
        if base in structures:
            continue
        if sub:
            flat.setdefault(base, {})[sub] = v
        else:
            out[k] = v
    for base, items in flat.items():
        out[base] = [items[s] for s in sorted(items, key=int)] if all(s.isdigit() for s in items) else items

    def build(prefix: str, spec: Any) -> Any:
        if spec == "tensor":
            return inputs[prefix]
        if not isinstance(spec, dict):
            return None
        if spec.get("type") == "dict":
            by_place = spec.get("indexed") is True
            items = {str(k): build(f"{prefix}.{i if by_place else k}", s)
                     for i, (k, s) in enumerate(zip(spec.get("keys", []), spec.get("items", [])))}
            klass = spec.get("class")
            return RecordedDict(klass, items) if isinstance(klass, str) else items
        if spec.get("type") == "value":
            value = spec.get("value")
            return value if isinstance(value, _JSON_LEAVES) else None
        if spec.get("type") == "object":
            fields = {str(k): build(f"{prefix}.{k}", s) for k, s in zip(spec.get("keys", []), spec.get("items", []))}
            return RecordedObject(str(spec.get("class", "")), fields)
        items = [build(f"{prefix}.{i}", s) for i, s in enumerate(spec.get("items", []))]
        return tuple(items) if spec.get("type") == "tuple" else items

    for base, spec in structures.items():
        out[base] = build(base, spec)
    return out
