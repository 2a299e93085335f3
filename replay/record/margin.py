"""The top-1/top-2 margin of a step's logits: how close the step came to picking another token."""

from __future__ import annotations

from typing import Any

import torch

from replay.format.ring_salvage import floats_at, margin_of
from replay.format.schema import dtype_to_str

__all__ = ["device_margin", "host_margin"]


def device_margin(t: torch.Tensor) -> torch.Tensor:
    """The top-1/top-2 margin (minimum over rows) as a device scalar, queued without a host sync.

    Not ``topk``: on CUDA it waits for the device (measured on an H200: ~0.3 ms a graph step, the
    whole queue on an eager one). The largest value, then the largest of the rest once its own
    slot is masked, give topk's two values, ties and NaN (the largest for both) included; half
    and bfloat16 widen to float32 exactly, after the reductions."""
    top1, idx = t.max(dim=-1, keepdim=True)
    rest = t.scatter(-1, idx, float("-inf"))
    top2 = rest.amax(dim=-1, keepdim=True)
    return (top1.float() - top2.float()).min()


def host_margin(m: Any) -> float:
    """The top-2 margin of logits copied to the host: numpy on the ring's bytes (as salvage
    computes it), else torch on a host tensor."""
    if isinstance(m, tuple):
        npv, dtype, shape = m
        return margin_of(floats_at(npv, 0, dtype_to_str(dtype), list(shape)))
    top = m.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())
