"""Nested containers of tensors as step arguments (an HF ``past_key_values``): flattened to
named inputs when recorded, rebuilt with their types and ``None`` holes when re-run. Shared by
``record`` and ``rerun``, below both."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["STRUCTURE_ARG", "flatten_tensors", "rebuild_inputs"]

# The recorded arguments' reserved key holding the shape of nested tensor arguments.
STRUCTURE_ARG = "__structure__"
_MAX_NESTED = 1 << 16


def flatten_tensors(name: str, v: Any) -> tuple[dict[str, torch.Tensor], Any] | None:
    """A container of tensors (lists, tuples, dicts, nested, with ``None`` holes: an HF
    ``past_key_values``) as ``{name.i.j: tensor}`` and its structure for ``rebuild_inputs``;
    None when ``v`` is not such a container (no tensor in it, or anything else inside)."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any, depth: int) -> Any:
        if isinstance(x, torch.Tensor):
            out[prefix] = x
            return "tensor"
        if x is None:
            return None
        if depth > 8 or len(out) > _MAX_NESTED:
            raise ValueError("too deep")
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return {"type": "tuple" if isinstance(x, tuple) else "list", "items": [walk(f"{prefix}.{i}", y, depth + 1) for i, y in enumerate(x)]}
        if isinstance(x, dict) and all(isinstance(k, str) and "." not in k for k in x):
            return {"type": "dict", "keys": list(x), "items": [walk(f"{prefix}.{k}", y, depth + 1) for k, y in x.items()]}
        raise ValueError("not a tensor container")

    try:
        structure = walk(name, v, 0)
    except ValueError:
        return None
    return (out, structure) if out else None


def rebuild_inputs(inputs: dict[str, torch.Tensor], structures: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inverse of ``split_arguments``'s flattening: ``{name: tensor or container}``.

    ``structures`` (the recorded ``__structure__`` argument) gives nested containers their
    types and ``None`` holes; without it, one level: digit keys make a list, others a dict."""
    structures = structures or {}
    out: dict[str, Any] = {}
    flat: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in inputs.items():
        base, dot, sub = k.partition(".")
        if base in structures:
            continue
        if dot:
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
            return {k: build(f"{prefix}.{k}", s) for k, s in zip(spec.get("keys", []), spec.get("items", []))}
        items = [build(f"{prefix}.{i}", s) for i, s in enumerate(spec.get("items", []))]
        return tuple(items) if spec.get("type") == "tuple" else items

    for base, spec in structures.items():
        out[base] = build(base, spec)
    return out
