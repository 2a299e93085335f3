"""How a step's outputs are named: the same names when recorded and when re-run."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NESTED_OUTPUT_BYTES", "name_outputs", "nested_outputs", "tensor_version", "written_arguments", "written_outputs"]


def name_outputs(out: Any, names: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """Tensors a step returned, by name: NamedTuple/dataclass fields, dict keys, or given names."""
    single = _single_output(out, names)
    if single is not None:
        return single
    pairs: list[tuple[str, Any]]
    if isinstance(out, dict):
        pairs = [(str(k), v) for k, v in out.items()]
    elif hasattr(out, "_fields"):
        pairs = list(zip(out._fields, out))
    elif hasattr(out, "__dataclass_fields__"):
        pairs = [(k, getattr(out, k)) for k in out.__dataclass_fields__]
    elif isinstance(out, (list, tuple)):
        pairs = _sequence_pairs(out, names)
    else:
        return {}
    named: dict[str, torch.Tensor] = {}
    for k, v in pairs:
        if isinstance(v, torch.Tensor):
            named[k] = v
        elif (numbers := _plain_numbers(v)) is not None:
            named[k] = numbers
        elif isinstance(v, (list, tuple, dict)):
            named.update(_small_container(k, v) or {})
    return named


_MAX_NUMBERS = 4096  # a longer list of numbers (a whole history) is not a step's output


def _plain_numbers(v: Any) -> torch.Tensor | None:
    """A Python number, or a flat list or tuple of them, a step returned beside its tensors
    (``return tok.item(), top_probs``): as a tensor of their exact values, so that it is
    recorded and compared; None for anything else."""
    if isinstance(v, (bool, int, float)):
        items = [v]
    elif isinstance(v, (list, tuple)) and 0 < len(v) <= _MAX_NUMBERS and all(type(x) in (bool, int, float) for x in v):
        items = list(v)
    else:
        return None
    kinds = {type(x) for x in items}
    dtype = torch.float64 if float in kinds else torch.int64 if int in kinds else torch.bool
    try:
        t = torch.tensor(items, dtype=dtype)
    except (OverflowError, RuntimeError):
        return None  # an int beyond int64
    return t.reshape(()) if not isinstance(v, (list, tuple)) else t


def _single_output(out: Any, names: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor] | None:
    """A result that is one output: a tensor, a Python number, or a flat list of numbers; None
    for a container of several."""
    if isinstance(out, torch.Tensor):
        if names:
            return {names[0]: out}
        # A lone floating output with a vocabulary-like last dimension is what a step's logits
        # look like; naming it so gives the margin and the logits ring without configuration.
        return {"logits" if out.is_floating_point() and out.dim() >= 2 else "output": out}
    if isinstance(out, (bool, int, float)):
        # A step that returns a Python number (the token it sampled, ``tok.item()``): recorded
        # and compared as a 0-dim tensor of its exact value.
        dtype = torch.bool if isinstance(out, bool) else torch.int64 if isinstance(out, int) else torch.float64
        return {names[0] if names else "output": torch.tensor(out, dtype=dtype)}
    numbers = _plain_numbers(out) if isinstance(out, (list, tuple)) else None
    if numbers is not None:
        # ``return logits.argmax(-1).tolist()``: one output of the numbers, not one per number.
        return {names[0] if names else "output": numbers}
    return None


# Tensors returned inside a container (``(logits, [h0, h1])``) are outputs too, named ``out1.0``,
# up to this many bytes a container: a larger one is usually the KV cache handed back every step,
# which copying or digesting every step would cost more than the step (the summary names it).
NESTED_OUTPUT_BYTES = 1 << 20


def _small_container(name: str, v: Any) -> dict[str, torch.Tensor] | None:
    from replay.core.structure import flatten_tensors

    found = flatten_tensors(name, v)
    if found is None or sum(t.numel() * t.element_size() for t in found[0].values()) > NESTED_OUTPUT_BYTES:
        return None
    return found[0]


def nested_outputs(out: Any, names: tuple[str, ...] | list[str]) -> list[str]:
    """What a step returned that ``name_outputs`` leaves out: a container holding tensors over
    ``NESTED_OUTPUT_BYTES`` (a ``past_key_values`` tuple), or one holding something besides
    tensors, e.g. ``"out1 (a list of 2 tensors)"``: said once at record time, never compared."""
    if isinstance(out, dict):
        pairs = [(str(k), v) for k, v in out.items()]
    elif hasattr(out, "_fields"):
        pairs = list(zip(out._fields, out))
    elif hasattr(out, "__dataclass_fields__"):
        pairs = [(k, getattr(out, k, None)) for k in out.__dataclass_fields__]
    elif isinstance(out, (list, tuple)):
        pairs = _sequence_pairs(out, names)
    else:
        return []
    said = []
    for k, v in pairs:
        if isinstance(v, (list, tuple, dict)) and _small_container(k, v) is None:
            n = _count_tensors(v, 0)
            if n:
                kind = "dict" if isinstance(v, dict) else "tuple" if isinstance(v, tuple) else "list"
                said.append(f"{k} (a {kind} of {n} tensor{'s' if n != 1 else ''})")
    return said


def _count_tensors(v: Any, depth: int) -> int:
    if isinstance(v, torch.Tensor):
        return 1
    if depth > 4:
        return 0
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
    return sum(_count_tensors(x, depth + 1) for x in items)


def _sequence_pairs(out: list | tuple, names: tuple[str, ...] | list[str]) -> list[tuple[str, Any]]:
    pairs = [(names[i] if i < len(names) else f"out{i}", v) for i, v in enumerate(out)]
    if names:
        return pairs
    shaped = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2]
    if len(shaped) == 1:
        # ``(logits, past_key_values)`` (HF, return_dict=False) or ``(token, logits)`` (gpt-fast):
        # the one floating output shaped like logits is named so, as a lone tensor would be.
        pairs[shaped[0]] = ("logits", out[shaped[0]])
    return pairs


def tensor_version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (moved by every in-place or ``out=`` write), or None: an
    inference tensor keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def written_arguments(tensors: dict[str, Any], scalars: dict[str, Any],
                      versions: dict[int, int | None] | None = None) -> dict[str, tuple[torch.Tensor, int | None]]:
    """The tensor arguments a step may write into, each with its version before the call (from
    ``versions`` by ``id`` when it was read earlier); a generator's recorded state is left out."""
    out = {}
    for n, t in tensors.items():
        if isinstance(t, torch.Tensor) and not (isinstance(scalars.get(n), dict) and "generator" in scalars[n]):
            out[n] = (t, versions.get(id(t)) if versions is not None else tensor_version(t))
    return out


def written_outputs(arguments: dict[str, tuple[torch.Tensor, int | None]]) -> dict[str, torch.Tensor]:
    """The outputs of a step that returned nothing (``step(ids, out=logits)``): the arguments it
    wrote into, by their input names, as they are after the call. Only those whose version moved:
    an argument the step left alone is its input again, and comparing it would compare nothing the
    step computed; an inference tensor, whose writes cannot be told, is left out for that reason."""
    return {n: t for n, (t, v) in arguments.items() if v is not None and tensor_version(t) != v}
