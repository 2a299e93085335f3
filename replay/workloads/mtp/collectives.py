"""The engine's collectives, all through torch.distributed's default group.

Every collective goes through a public ``torch.distributed`` call, so a recorder that wraps those
calls sees them, and a single-rank replay can answer them from a recording through a fake backend.
The one-shot all-reduce is the fourth cause of drift: like a custom one-stage all-reduce it
gathers every rank's partial and sums locally, but starts the sum at its own rank, so floating
point gives each rank different bits (with three or more ranks: two-term sums commute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "AllReduce",
    "all_gather_rows",
    "broadcast_",
    "broadcast_int",
    "one_shot_all_reduce",
    "require_group",
]


def require_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "this engine was built with world_size > 1 but torch.distributed has no default group; "
            "call torch.distributed.init_process_group first (launch.run and torchrun do)"
        )


def one_shot_all_reduce(x: torch.Tensor) -> torch.Tensor:
    require_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    # Rank-rotated order: rank r computes ((p_r + p_{r+1}) + ...), a different rounding per rank.
    out = parts[rank].clone()
    for i in range(1, world):
        out += parts[(rank + i) % world]
    return out


class AllReduce:
    """The reduction a tensor-parallel module applies to its partial output."""

    def __init__(self, *, one_shot: bool) -> None:
        self.one_shot = one_shot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_shot:
            return one_shot_all_reduce(x)
        require_group()
        dist.all_reduce(x)
        return x

    def __repr__(self) -> str:
        return f"AllReduce(one_shot={self.one_shot})"


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Stack every rank's ``x``: ``[world, *x.shape]``."""
    require_group()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    require_group()
    dist.broadcast(x, src=src)
    return x


def broadcast_int(value: int, *, src: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    return int(broadcast_(t, src=src).item())
