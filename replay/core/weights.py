"""Per-parameter digests of an ``nn.Module`` target, taken once per rank and stream.

Stored in the target info as ``"weights": {name: {"digest": 16 hex, "shape": [...], "dtype":
"torch.float32"}}``, so a re-run can say which rebuilt weights are not the weights that ran, and
``replay diff`` which weights differ between two runs.

A parameter's shard layout is recorded with it, under ``"layout"``, only where it is certain:

- a DTensor says it: ``{"placements": ["Shard(dim=0)"], "mesh": [8], "global_shape": [...]}``
  (``shape`` and ``digest`` stay the local shard's);
- a plain tensor is laid out as the user declared (``declared``: a name or glob -> shard dim,
  e.g. ``{"*.wo.weight": 1}``): ``{"shard_dim": 1, "declared": true}``.

Nothing is inferred from shapes: a plain tensor nobody declared has no ``"layout"``.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from replay.digest import digest_many, format_digest, local_tensor

__all__ = ["buffer_digests", "param_layout", "weight_digests", "weight_shapes"]


def weight_digests(module: torch.nn.Module, declared: Mapping[str, int] | None = None) -> dict[str, dict[str, Any]]:
    names, tensors, layouts = [], [], []
    for name, p in module.named_parameters(remove_duplicate=True):
        names.append(name)
        tensors.append(local_tensor(p.detach()))
        layouts.append(param_layout(name, p, declared))
    packed = _packed_weights(module)
    digests = digest_many(tensors + [b for _, b, _, _ in packed])
    out: dict[str, dict[str, Any]] = {}
    for n, t, d, lay in zip(names, tensors, digests, layouts, strict=False):
        out[n] = {"digest": format_digest(d), "shape": list(t.shape), "dtype": str(t.dtype)}
        if lay is not None:
            out[n]["layout"] = lay
    for (n, _, shape, dtype), d in zip(packed, digests[len(tensors):], strict=True):
        out.setdefault(n, {"digest": format_digest(d), "shape": shape, "dtype": dtype})
    return out


def weight_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """The names and shapes ``weight_digests`` would give, without digesting anything."""
    out = {n: list(local_tensor(p).shape) for n, p in module.named_parameters(remove_duplicate=True)}
    for n, _, shape, _ in _packed_weights(module):
        out.setdefault(n, shape)
    return out


def _packed_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, list[int], str]]:
    """Weights that are neither parameters nor buffers: a quantised module's packed ones
    (``torch.ao`` dynamic or static quantised Linear and Conv hold them in a ``_packed_params``
    script object, read back by their ``weight()`` and ``bias()`` methods). Each as (name, its
    bytes with the quantisation's scales and zero points, shape, dtype)."""
    out = []
    for prefix, m in module.named_modules(remove_duplicate=True):
        if not hasattr(m, "_packed_params") or not callable(getattr(m, "weight", None)):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao's deprecation notes are not the program's to see
                parts = [("weight", m.weight())]
                if callable(getattr(m, "bias", None)):
                    parts.append(("bias", m.bias()))
        except Exception:  # noqa: BLE001 - a module that cannot unpack: nothing to digest
            continue
        for leaf, t in parts:
            if isinstance(t, torch.Tensor):
                out.append((f"{prefix}.{leaf}" if prefix else leaf, _quantised_bytes(t.detach()), list(t.shape), str(t.dtype)))
    return out


def _quantised_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes; a quantised one's integers, then its scales and zero points."""
    if not t.is_quantized:
        return t.contiguous().reshape(-1).view(torch.uint8)
    if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams):
        scales = t.q_per_channel_scales().to(torch.float64)
        zeros = t.q_per_channel_zero_points().to(torch.float64)
    else:
        scales = torch.tensor([t.q_scale()], dtype=torch.float64)
        zeros = torch.tensor([float(t.q_zero_point())], dtype=torch.float64)
    ints = t.int_repr().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([ints.cpu(), scales.cpu().view(torch.uint8), zeros.cpu().view(torch.uint8)])


def buffer_digests(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per-buffer digests, as they are when taken (``"buffers"`` in the target info): the weights
    of a quantised model (int8 ``wq`` and its scales) live in buffers, and so do caches, which
    is why they are kept apart from the parameters."""
    names, tensors = [], []
    for name, b in module.named_buffers(remove_duplicate=True):
        if isinstance(b, torch.Tensor):
            names.append(name)
            tensors.append(local_tensor(b.detach()))
    return {n: {"digest": format_digest(d), "shape": list(t.shape), "dtype": str(t.dtype)}
            for n, t, d in zip(names, tensors, digest_many(tensors), strict=True)}


def param_layout(name: str, p: torch.Tensor, declared: Mapping[str, int] | None = None) -> dict[str, Any] | None:
    """The shard layout of one parameter, where it is known for certain (see the module docstring)."""
    placements = getattr(p, "placements", None)
    if placements is not None and callable(getattr(type(p), "to_local", None)):  # a DTensor
        mesh = getattr(p, "device_mesh", None)
        return {"placements": [_placement(pl) for pl in placements],
                "mesh": [int(x) for x in mesh.shape] if mesh is not None else None,
                "global_shape": [int(x) for x in p.shape]}
    for pattern, dim in (declared or {}).items():
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            return {"shard_dim": int(dim), "declared": True}
    return None


def _placement(pl: Any) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``: the form ``replay.analysis.unshard`` reads
    (``str()`` of a placement is a short form, ``S(0)``, that changes between torch versions)."""
    if callable(getattr(pl, "is_shard", None)) and pl.is_shard():
        return f"Shard({int(pl.dim)})"
    if callable(getattr(pl, "is_replicate", None)) and pl.is_replicate():
        return "Replicate()"
    if callable(getattr(pl, "is_partial", None)) and pl.is_partial():
        return f"Partial({getattr(pl, 'reduce_op', '')})"
    return repr(pl)


# How many parameter names a change keeps and says (a model swapped whole has thousands).
_CHANGE_NAMES = 8


def parameter_changes(recorded: Mapping[str, Mapping[str, Any]], module: torch.nn.Module) -> dict[str, Any] | None:
    """How ``module``'s parameters now differ in names and shapes from ``recorded`` (the
    ``weight_digests`` of its first recorded step): ``{"added", "removed", "reshaped"}`` (a few
    names each, with counts), None when they do not. Only names and shapes: nothing is digested
    (a model the program changed in place keeps its names)."""
    now = weight_shapes(module)
    added = [n for n in now if n not in recorded]
    removed = [n for n in recorded if n not in now]
    reshaped = [n for n in now if n in recorded and list(recorded[n].get("shape") or []) != list(now[n])]
    if not (added or removed or reshaped):
        return None
    return {k: {"count": len(v), "names": v[:_CHANGE_NAMES]} for k, v in
            (("added", added), ("removed", removed), ("reshaped", reshaped)) if v}


def describe_parameter_changes(changes: Mapping[str, Any]) -> str:
    """``parameter_changes`` in words: "2 added (l2.lora_A, l2.lora_B), 1 removed (l2.weight)"."""
    parts = []
    for what in ("added", "removed", "reshaped"):
        c = changes.get(what)
        if isinstance(c, Mapping) and isinstance(c.get("count"), int) and c["count"] > 0:
            names = [str(n) for n in c.get("names") or []]
            more = ", ..." if c["count"] > len(names) else ""
            parts.append(f"{c['count']} {what} ({', '.join(names)}{more})")
    return ", ".join(parts)
