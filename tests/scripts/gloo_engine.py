"""A tiny multi-rank "engine" for fault, fuzz and soak tests: one gloo all_reduce per step.

It knows nothing about ``replay``: ``replay record --step gloo_engine:Engine.step --state state``
instruments it from outside, as it would a real engine. Faults are switched on by the launcher
(``gloo_ranks.py``): a rank can raise inside a step, or never join a step's collective.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["Engine"]


class Engine:
    def __init__(
        self,
        rank: int,
        *,
        width: int = 16,
        raise_at: int | None = None,
        hang_at: int | None = None,
        step_sleep: float = 0.0,
    ) -> None:
        g = torch.Generator().manual_seed(1234)
        self.w = torch.randn(width, width, generator=g) / width**0.5
        self.kv = torch.zeros(4, width)
        self.rank = rank
        self.raise_at = raise_at
        self.hang_at = hang_at
        self.step_sleep = step_sleep

    def state(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv}

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        # x: [2, width]
        h = torch.tanh(x @ self.w + 0.01 * self.rank)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if pos == self.raise_at:
            raise ValueError(f"rank {self.rank} raised at step {pos} (injected fault)")
        if pos == self.hang_at:
            # Never join this step's collective: the other ranks' collective times out.
            while True:
                time.sleep(1.0)
        dist.all_reduce(h)
        self.kv[pos % 4] = h[0]
        return h
