"""What a step's target carries from one step to the next: tensors, and Python scalars.

Tensors: an ``nn.Module``'s buffers and non-parameter tensor attributes (``module_state``).
Scalars: the ``int``, ``float`` and ``bool`` attributes of the target object itself (a step
counter, an ``input_pos`` kept as an int, a cache length), and its short ``str`` ones (the active
adapter's name, kept as UTF-8 bytes under ``STR_PREFIX``). An engine that keeps such a counter
on the Python side computes something else, or just says "decode step 0", when a re-run restores
its tensors but not its counter. Keyframes hold them as 0-d tensors, so the file format does not
change: those that changed since the first keyframe under ``SCALAR_PREFIX + name``, the others
(maybe configuration) under ``UNCHANGED_PREFIX + name``; a re-run splits them off again
(``split_scalars``) and sets them on the rebuilt object (``restore_scalars``): the changed ones
always, the others only on the recorded program's own object (a re-launched program).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

from replay.core.host_generators import host_generator_state, is_host_generator, set_host_generator_state

__all__ = ["SCALAR_PREFIX", "UNCHANGED_PREFIX", "STR_PREFIX", "STR_UNCHANGED_PREFIX", "GENERATOR_PREFIX", "module_state", "named_state", "held_module",
           "held_module_state", "capture_generators",
           "split_generators", "restore_generators", "capture_scalars", "split_scalars", "restore_scalars", "with_scalars"]

SCALAR_PREFIX = "__py__."
UNCHANGED_PREFIX = "__pyfixed__."  # a scalar that had not changed since the first keyframe
# A str attribute (the active LoRA adapter's name, a mode the loop sets between steps): its UTF-8
# bytes as a uint8 tensor, under these prefixes (changed since the first keyframe, or not).
STR_PREFIX = "__pystr__."
STR_UNCHANGED_PREFIX = "__pystrfixed__."
_MAX_STR = 256  # a longer str attribute is text, not step state
# The state of a generator the target holds: a torch.Generator (uint8, as get_state), or a host
# one (numpy's, random's: uint8 JSON bytes, replay.core.host_generators).
GENERATOR_PREFIX = "__gen__."
_MAX_GENERATORS = 64
_MAX_SCALARS = 256  # a target object with more scalar attributes than this is not a step's state
# Its submodules' (a model's layers hold their sizes, epsilons, dropout rates): past this many in
# all, none are kept.
_MAX_SUBMODULE_SCALARS = 16384
_INT64 = (-(1 << 63), (1 << 63) - 1)


def named_state(value: Any, name: str) -> dict[str, torch.Tensor]:
    """What ``--state NAME`` names, as keyframes hold it: a dict of tensors (or pairs), or one
    tensor, kept under ``NAME`` (a KV pool held as ``engine.kv``); an ``nn.Module`` (``--state
    model``) stands for its buffers (``module_state``), kept as ``NAME.<buffer>``."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    if value is None:
        return {}
    if isinstance(value, torch.nn.Module):
        return {f"{name}.{k}": v for k, v in module_state(value).items()}
    try:
        return dict(value)
    except (TypeError, ValueError):
        raise TypeError(f"--state {name} is a {type(value).__name__}: it must name a tensor, a dict of tensors, "
                        "or a method returning one") from None


def held_module(obj: Any) -> tuple[str, torch.nn.Module] | None:
    """The one ``nn.Module`` an engine object that is not a module holds as an attribute
    (``Engine.model``): (attribute, module); None when it holds none or several. The step of
    such an object (``Engine.step``) runs that model: its weights and buffers are the step's."""
    if obj is None or isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
        return None
    try:
        found = [(k, v) for k, v in vars(obj).items() if isinstance(v, torch.nn.Module)]
    except TypeError:
        return None
    return found[0] if len(found) == 1 else None


def held_module_state(obj: Any) -> dict[str, torch.Tensor] | None:
    """The default keyframe state of an engine object that holds one model: that model's
    buffers, named ``<attribute>.<buffer>`` (as ``--state <attribute>`` names them); None when
    the object is a module itself, or holds none or several."""
    held = held_module(obj)
    return None if held is None else named_state(held[1], held[0])


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What carries over from one step of an ``nn.Module`` to the next, by default: its buffers
    (KV caches, counters) and the tensors its submodules hold as plain attributes, never its
    parameters (the weights are rebuilt, and digested once instead). Names are dotted paths
    from ``module`` (``layers.0.attention.kv_cache.k_cache``), the form a re-run restores by."""
    out: dict[str, torch.Tensor] = {}
    for name, b in module.named_buffers(remove_duplicate=True):
        if b is not None:
            out[name] = b
    params = {id(p) for p in module.parameters()}
    seen = {id(t) for t in out.values()} | params
    for prefix, m in module.named_modules():
        for attr, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and id(v) not in seen and not attr.startswith("__"):
                seen.add(id(v))
                out[f"{prefix}.{attr}" if prefix else attr] = v
    return out


@functools.cache
def _module_internals() -> frozenset[str]:
    """Attribute names every nn.Module has (``training``, hook flags): not the program's state."""
    return frozenset(vars(torch.nn.Module()))


def _scalar_items(obj: Any) -> list[tuple[str, Any]]:
    try:
        items = list(vars(obj).items())
    except TypeError:  # no __dict__ (slots, builtins)
        return []
    skip = _module_internals() if isinstance(obj, torch.nn.Module) else frozenset()
    out = []
    for name, v in items:
        if type(v) is str and len(v) <= _MAX_STR and not name.startswith("__") and name not in skip:
            out.append((name, v))
            continue
        if name.startswith("__") or name in skip or type(v) not in (int, float, bool):
            continue  # exact types only: an IntEnum or a numpy scalar is configuration, not a counter
        if type(v) is int and not _INT64[0] <= v <= _INT64[1]:
            continue
        out.append((name, v))
    return out


def _submodule_scalar_items(obj: Any) -> list[tuple[str, Any]]:
    """The same attributes of the modules below the target (a flag the loop sets on
    ``model.layers[1].mlp``), by dotted path from the target (``layers.1.mlp.bug``, or
    ``lm.layers.1.mlp.bug`` for an engine holding its model as ``lm``); none past a bound."""
    if isinstance(obj, torch.nn.Module):
        modules = ((p, m) for p, m in obj.named_modules() if p)
    else:
        held = held_module(obj)
        modules = held[1].named_modules(prefix=held[0]) if held is not None else iter(())
    out: list[tuple[str, Any]] = []
    for prefix, m in modules:
        out += [(f"{prefix}.{name}", v) for name, v in _scalar_items(m)]
        if len(out) > _MAX_SUBMODULE_SCALARS:
            return []
    return out


def _all_scalar_items(obj: Any) -> list[tuple[str, Any]]:
    items = _scalar_items(obj)
    if len(items) > _MAX_SCALARS:
        items = []
    return items + _submodule_scalar_items(obj)


def capture_scalars(obj: Any) -> dict[str, torch.Tensor]:
    """The target object's own int/float/bool/short str attributes, and its submodules' (by
    dotted path), as CPU tensors under the reserved keyframe names. Empty for an object without
    any (or with too many to be step state)."""
    items = _all_scalar_items(obj)
    if not items:
        return {}
    out = {}
    for name, v in items:
        if type(v) is str:
            out[STR_PREFIX + name] = torch.tensor(list(v.encode()), dtype=torch.uint8)
            continue
        dtype = torch.bool if type(v) is bool else torch.int64 if type(v) is int else torch.float64
        out[SCALAR_PREFIX + name] = torch.tensor(v, dtype=dtype)
    return out


def _value(key: str, t: torch.Tensor) -> Any:
    """A kept attribute's Python value: a str from its bytes, else the 0-d tensor's item."""
    if key.startswith((STR_PREFIX, STR_UNCHANGED_PREFIX)):
        return bytes(t.to(torch.uint8).tolist()).decode("utf-8", "replace")
    return bool(t.item()) if t.dtype == torch.bool else t.item()


def _of_submodule(key: str) -> bool:
    """A kept attribute of a module below the target (its name after the prefix is a path)."""
    return "." in key.split(".", 1)[1]


def _unchanged_key(key: str) -> str:
    if key.startswith(STR_PREFIX):
        return STR_UNCHANGED_PREFIX + key[len(STR_PREFIX):]
    return UNCHANGED_PREFIX + key[len(SCALAR_PREFIX):]


def with_scalars(state_fn: Callable[[], dict[str, torch.Tensor]] | None, obj_ref: Callable[[], Any]) -> Callable[[], dict[str, torch.Tensor]] | None:
    """``state_fn`` (a target's keyframe tensors) with the object's scalar state added; never
    raises into the recorder for the scalars' sake."""
    if state_fn is None:
        return None
    first: dict[str, Any] = {}
    moved: set[str] = set()

    def state_and_scalars() -> dict[str, torch.Tensor]:
        state = dict(state_fn())
        try:
            obj = obj_ref()
            if obj is not None:
                now = capture_scalars(obj)
                if not first:
                    first.update({k: _value(k, v) for k, v in now.items()} or {"": None})
                # What changed since the first keyframe is step state (a counter); a value that
                # never changed may be configuration, which a re-run of a rebuilt target must not
                # paper over (one configured otherwise has to show as such). It is kept apart: a
                # re-run inside the recorded program sets it back on the program's own object,
                # whose calls before the first recorded one (found with no flags) moved it.
                for k, v in now.items():
                    changed = k in moved or k not in first or first[k] != _value(k, v)
                    if _of_submodule(k):
                        if not changed:
                            continue  # never changed: a layer's size, its epsilon
                        moved.add(k)  # kept from its first change on (set back, it says so)
                    state[k if changed else _unchanged_key(k)] = v
                state.update(capture_generators(obj))
        except Exception:  # noqa: BLE001 - the scalars are extra; the tensors are the keyframe
            pass
        return state

    return state_and_scalars


def split_scalars(state: dict[str, torch.Tensor], unchanged: dict[str, bool | int | float] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, bool | int | float]]:
    """A keyframe's tensors and its Python scalars that changed since the first keyframe (by
    attribute name, as Python values); those that had not go into ``unchanged`` when given."""
    tensors, scalars = {}, {}
    for k, v in state.items():
        for prefix, into in ((SCALAR_PREFIX, scalars), (UNCHANGED_PREFIX, unchanged),
                             (STR_PREFIX, scalars), (STR_UNCHANGED_PREFIX, unchanged)):
            if k.startswith(prefix) and isinstance(v, torch.Tensor) and (v.numel() == 1 or prefix.startswith("__pystr")):
                if into is not None:
                    into[k[len(prefix):]] = _value(k, v)
                break
        else:
            tensors[k] = v
    return tensors, scalars


def restore_scalars(obj: Any, scalars: dict[str, bool | int | float]) -> list[str]:
    """Set the recorded scalars on ``obj``; only attributes it has, of the same Python type
    (never a new attribute, never a property). Returns the names it could not set."""
    if not scalars:
        return []
    live = dict(_all_scalar_items(obj)) if obj is not None else {}
    failed = []
    for name, value in scalars.items():
        if name not in live or type(live[name]) is not type(value):
            failed.append(name)
            continue
        owner, _, attr = name.rpartition(".")
        setattr(_at_path(obj, owner) if owner else obj, attr, value)
    return failed


def _at_path(obj: Any, path: str) -> Any:
    """The module at a dotted path from the target (``layers.1.mlp``: a ModuleList's entries
    are attributes by their index)."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# Held objects that are code, not state: never looked into for generators.
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, functools.partial, type)


def _generators(obj: Any) -> dict[str, Any]:
    """The generators the target holds, by dotted path: ``torch.Generator``s and the host's
    (``numpy.random.Generator``, ``RandomState``, ``random.Random``); its own attributes, those of
    its submodules (an ``nn.Module``), and those of the plain objects it holds one level down (a
    sampler's, a callable sampler's too). A program that samples with its own generator draws
    from these, not from the process-wide sources the step's RNG record restores."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def look(prefix: str, o: Any, depth: int) -> None:
        try:
            items = list(vars(o).items())
        except Exception:  # noqa: BLE001 - no __dict__ (slots, builtins), or one that refuses
            return
        for name, v in items:
            if name.startswith("__") or len(found) >= _MAX_GENERATORS:
                continue
            if isinstance(v, torch.Generator) or is_host_generator(v):
                if id(v) not in seen:
                    seen.add(id(v))
                    found[f"{prefix}{name}"] = v
            elif depth == 0 and not isinstance(v, (torch.nn.Module, torch.Tensor, *_CODE)) and hasattr(v, "__dict__"):
                look(f"{prefix}{name}.", v, depth + 1)

    if isinstance(obj, torch.nn.Module):
        for mod_name, m in obj.named_modules():
            look(f"{mod_name}." if mod_name else "", m, 0 if not mod_name else 1)
    elif obj is not None:
        look("", obj, 0)
    return found


def capture_generators(obj: Any) -> dict[str, torch.Tensor]:
    """The state of each generator the target holds (``_generators``), under the keyframe's
    reserved names; never raises (a generator that cannot say its state is left out)."""
    out = {}
    try:
        for path, g in _generators(obj).items():
            try:
                out[GENERATOR_PREFIX + path] = g.get_state() if isinstance(g, torch.Generator) else host_generator_state(g)
            except Exception:  # noqa: BLE001
                continue
    except Exception:  # noqa: BLE001
        return {}
    return out


def split_generators(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A keyframe without its generator states, and those states by path."""
    gens = {k[len(GENERATOR_PREFIX):]: v for k, v in state.items() if k.startswith(GENERATOR_PREFIX)}
    return ({k: v for k, v in state.items() if not k.startswith(GENERATOR_PREFIX)} if gens else state), gens


def restore_generators(obj: Any, states: dict[str, torch.Tensor]) -> list[str]:
    """Set each recorded generator state on the target's generator of that path; returns the
    paths it could not set (no such generator, or a state of another kind)."""
    if not states:
        return []
    try:
        live = _generators(obj)
    except Exception:  # noqa: BLE001 - said by the caller as not restored
        live = {}
    failed = []
    for path, st in states.items():
        g = live.get(path)
        try:
            if g is None:
                raise KeyError(path)
            if isinstance(g, torch.Generator):
                g.set_state(st.to("cpu", torch.uint8))
            else:
                set_host_generator_state(g, st)
        except Exception:  # noqa: BLE001 - said by the caller, never a traceback
            failed.append(path)
    return failed
