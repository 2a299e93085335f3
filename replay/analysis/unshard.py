"""A field's recorded tensor, and a sharded field put back together across a part's ranks.

A field (``output.hidden``) maps to one ``/tensors`` row of its step. Across tensor-parallel
layouts a field is compared whole: each side's shards are concatenated along the dimension its
layout names, then the two whole tensors are compared. The layout comes from the recording
(``attrs["target"]["layout"]``, see ``docs/diff.md``: DTensor placements, or a declared shard
dimension for plain-tensor TP) or from the user (``--shard FIELD=DIM``). A field kept as a digest
only cannot be put back together: that is said, never guessed.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from typing import TYPE_CHECKING

from replay._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

from replay.errors import RecordingDamaged
from replay.format.reader import RankFile
from replay.format.schema import TensorKind

__all__ = ["Layout", "LayoutKind", "Missing", "field_layout", "field_row", "field_shape", "field_tensor", "layout_of",
           "param_global_shape", "whole_tensor"]

_SHARD = re.compile(r"^\s*Shard\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)\s*$")
_REPLICATE = re.compile(r"^\s*Replicate\(\s*\)\s*$")
_PARTIAL = re.compile(r"^\s*Partial\(.*\)\s*$|^\s*_Partial\(.*\)\s*$")


class LayoutKind(enum.Enum):
    REPLICATED = "replicated"  # every rank holds the whole tensor (or nothing says otherwise)
    SHARDED = "sharded"  # split along ``dim`` over the part's ranks, in rank order
    PARTIAL = "partial"  # a pending reduction: the bits of the sum cannot be rebuilt exactly
    UNSUPPORTED = "unsupported"  # a layout this version cannot rebuild (a 2-D mesh, say)


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    kind: LayoutKind
    dim: int | None = None
    source: str = ""  # "recorded placements", "recorded shard_dim", "--shard", "none recorded"
    detail: str = ""

    def describe(self) -> str:
        if self.kind is LayoutKind.SHARDED:
            return f"sharded on dim {self.dim} ({self.source})"
        if self.kind is LayoutKind.REPLICATED:
            return f"replicated ({self.source})"
        return f"{self.kind.value}: {self.detail} ({self.source})"


def _declared(attrs: Mapping[str, Any], field: str) -> Any:
    target = attrs.get("target")
    if not isinstance(target, dict):
        return None
    layout = target.get("layout")
    if not isinstance(layout, dict):
        return None
    fields = layout.get("fields")
    return fields.get(field) if isinstance(fields, dict) else None


def field_layout(attrs: Mapping[str, Any], field: str, declared: Mapping[str, int]) -> Layout:
    """How ``field`` is laid out over a part's ranks: ``--shard`` first, then the recording."""
    if field in declared:
        return Layout(kind=LayoutKind.SHARDED, dim=int(declared[field]), source="--shard")
    spec = _declared(attrs, field)
    if spec is None:
        return Layout(kind=LayoutKind.REPLICATED, source="no layout recorded")
    return layout_of(spec)


def layout_of(spec: Any) -> Layout:
    """A recorded layout (``{"placements": [...]}``, ``{"shard_dim": d}``, ``{"replicated": true}``)."""
    if not isinstance(spec, dict):
        return Layout(kind=LayoutKind.UNSUPPORTED, detail=f"layout {str(spec)[:60]!r} is not understood", source="recorded")
    if "placements" in spec:
        return _placements(spec["placements"])
    dim = spec.get("shard_dim")
    if isinstance(dim, int) and not isinstance(dim, bool):
        return Layout(kind=LayoutKind.SHARDED, dim=dim, source="declared shard_dim" if spec.get("declared") else "recorded shard_dim")
    if dim is None and spec.get("replicated") is True:
        return Layout(kind=LayoutKind.REPLICATED, source="recorded")
    return Layout(kind=LayoutKind.UNSUPPORTED, detail="no placements or shard_dim", source="recorded")


def _placements(pl: Any) -> Layout:
    """DTensor placements over a 1-D mesh; anything else cannot be rebuilt (said, not guessed)."""
    if not isinstance(pl, list) or not pl:
        return Layout(kind=LayoutKind.UNSUPPORTED, detail="placements is not a list", source="recorded placements")
    if len(pl) > 1:
        return Layout(kind=LayoutKind.UNSUPPORTED, detail=f"a {len(pl)}-D device mesh ({', '.join(map(str, pl))})",
                      source="recorded placements")
    p = str(pl[0])
    if m := _SHARD.match(p):
        return Layout(kind=LayoutKind.SHARDED, dim=int(m.group(1)), source="recorded placements")
    if _REPLICATE.match(p):
        return Layout(kind=LayoutKind.REPLICATED, source="recorded placements")
    if _PARTIAL.match(p):
        return Layout(kind=LayoutKind.PARTIAL, detail=f"{p}: each rank holds a summand", source="recorded placements")
    return Layout(kind=LayoutKind.UNSUPPORTED, detail=f"placement {p[:40]!r}", source="recorded placements")


def param_global_shape(entry: Mapping[str, Any], world: int) -> tuple[int, ...] | None:
    """The whole shape of a recorded parameter (``replay.record.weights``), or None when its
    layout is not recorded: a DTensor's global shape; a declared shard's local shape with the
    shard dimension times ``world`` (plain-tensor TP splits evenly); a replicated one's own shape;
    any parameter's own shape when ``world`` is 1."""
    lay = entry.get("layout")
    shape = entry.get("shape")
    if not isinstance(shape, list):
        return None
    if not isinstance(lay, dict):
        return tuple(shape) if world == 1 else None  # one rank holds every tensor whole
    g = lay.get("global_shape")
    if isinstance(g, list) and all(isinstance(x, int) for x in g):
        return tuple(g)
    layout = layout_of(lay)
    if layout.kind is LayoutKind.REPLICATED:
        return tuple(shape)
    if layout.kind is not LayoutKind.SHARDED or layout.dim is None or not -len(shape) <= layout.dim < len(shape):
        return None
    whole = list(shape)
    whole[layout.dim] *= world
    return tuple(whole)


class Missing(str):
    """Why a field's tensor cannot be had (a ``str`` so that it reads as the reason)."""


_KIND = {"input.": TensorKind.INPUT, "output.": TensorKind.OUTPUT, "tokens.": TensorKind.TOKENS}


def field_row(rf: RankFile, step: int, field: str) -> np.void | Missing:
    """The /tensors row behind ``field`` at ``step``, or why there is none."""
    if rf.tables.payload_size == 0:
        # No tensor bytes at all: known from the summary, without reading /tensors.
        return Missing("recorded as a digest only")
    if field.startswith("collective."):
        return _collective_row(rf, step, field)
    kind = next((k for p, k in _KIND.items() if field.startswith(p)), None)
    if kind is None:
        return Missing(f"{field} has no tensor (it is a digest of the step's graph/mode)")
    t = rf.full()
    name = field.split(".", 1)[1]
    rows = rf.tensor_rows(step)
    found = [r for r in rows if int(r["kind"]) == int(kind) and t.string(int(r["name"])) == name]
    if kind is TensorKind.OUTPUT and (not found or int(found[-1]["offset"]) < 0):
        ring = _logits_ring_row(rf, rows, name)
        if ring is not None:
            return ring
    if not found:
        return Missing(f"{field} has no tensor row at step {step}")
    if int(found[-1]["offset"]) < 0:
        return Missing("recorded as a digest only")
    return found[-1]


def _collective_row(rf: RankFile, step: int, field: str) -> np.void | Missing:
    """``collective.N...``: the output of the step's N-th collective, when kept in full."""
    t = rf.full()
    c = t.collectives[t.collectives["step"] == step]
    c = c[np.argsort(c["ordinal"], kind="stable")]
    try:
        n = int(field.split(".")[1])
    except (IndexError, ValueError):
        return Missing(f"{field}: not a collective field name")
    if n >= c.size or int(c["out_tensor"][n]) < 0:
        return Missing("collective output recorded as a digest only")
    i = int(c["out_tensor"][n])
    if i >= t.tensors.size:
        raise RecordingDamaged(f"{rf.path}: collective of step {step} points outside /tensors")
    return t.tensors[i]


def _logits_ring_row(rf: RankFile, rows: Any, name: str) -> np.void | None:
    """Outputs are digests by default; the logits ring may still hold this step's logits."""
    logits_name = (rf.attrs.get("recorder") or {}).get("logits", "logits")
    if name != logits_name:
        return None
    ring = [r for r in rows if int(r["kind"]) == int(TensorKind.LOGITS)]
    return ring[-1] if ring else None


def field_tensor(rf: RankFile, step: int, field: str) -> torch.Tensor | Missing:
    """The tensor of ``field`` at ``step`` on this rank, bit for bit, or why it cannot be had."""
    row = field_row(rf, step, field)
    if isinstance(row, Missing):
        return row
    return rf.read_tensor(row)


def field_shape(rf: RankFile, step: int, field: str) -> tuple[int, ...] | None:
    """The recorded shape of ``field`` at ``step`` (known for digest-only tensors too)."""
    if not any(field.startswith(p) for p in _KIND):
        return None
    t = rf.full()
    kind, name = next(k for p, k in _KIND.items() if field.startswith(p)), field.split(".", 1)[1]
    for r in rf.tensor_rows(step):
        if int(r["kind"]) == int(kind) and t.string(int(r["name"])) == name:
            return tuple(int(x) for x in r["shape"][: int(r["ndim"])])
    return None


def whole_tensor(files: list[RankFile], step: int, field: str, layout: Layout) -> torch.Tensor | Missing:
    """``field`` at ``step`` as one tensor: rank 0's when replicated, the shards concatenated in
    rank order when sharded; or why it cannot be rebuilt."""
    if layout.kind in (LayoutKind.PARTIAL, LayoutKind.UNSUPPORTED):
        return Missing(f"cannot be unsharded: {layout.detail}")
    if layout.kind is LayoutKind.REPLICATED or len(files) == 1:
        return field_tensor(files[0], step, field)
    shards = []
    for rf in files:
        t = field_tensor(rf, step, field)
        if isinstance(t, Missing):
            return Missing(f"sharded on dim {layout.dim} and {t} on rank {rf.rank}: it cannot be unsharded")
        shards.append(t)
    try:
        return torch.cat(shards, dim=int(layout.dim or 0))
    except (RuntimeError, IndexError) as e:
        return Missing(f"shards do not fit together on dim {layout.dim} ({str(e).splitlines()[0][:80]})")
