"""Per-parameter digests of an ``nn.Module`` target, taken once per rank and stream.

Stored in the target info as ``"weights": {name: {"digest": 16 hex, "shape": [...], "dtype":
"torch.float32"}}``, so a re-run can say which rebuilt weights are not the weights that ran."""

from __future__ import annotations

from typing import Any

import torch

from replay.digest import digest_many, format_digest, local_tensor

__all__ = ["weight_digests"]


def weight_digests(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    names, tensors = [], []
    for name, p in module.named_parameters(remove_duplicate=True):
        names.append(name)
        tensors.append(local_tensor(p.detach()))
    digests = digest_many(tensors)
    return {
        n: {"digest": format_digest(d), "shape": list(t.shape), "dtype": str(t.dtype)}
        for n, t, d in zip(names, tensors, digests, strict=True)
    }
