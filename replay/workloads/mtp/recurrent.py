"""A gated linear recurrence with a per-slot state: the Mamba stand-in of the hybrid model.

Unlike a KV cache, a recurrent state cannot be "un-written" by moving a position back: after a
verify forward over k+1 positions the state has consumed drafts that may be rejected. So verify
keeps the state after every position (as TensorRT-LLM's intermediate SSM state cache does) and
`commit` promotes the one after the last accepted token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replay.workloads.mtp.attention import ForwardMeta
from replay.workloads.mtp.config import ModelArgs

__all__ = ["Recurrent"]


class Recurrent(nn.Module):
    state: torch.Tensor
    """[slots, C] committed state of each slot."""
    intermediate: torch.Tensor
    """[slots, k+1, C] state after each position of the last verify forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.state_dim = args.state_dim
        self.w_decay = nn.Linear(args.dim, args.state_dim, bias=True)
        self.w_in = nn.Linear(args.dim, args.state_dim, bias=False)
        self.w_gate = nn.Linear(args.dim, args.state_dim, bias=False)
        self.w_out = nn.Linear(args.state_dim, args.dim, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by the TP transform: all-reduce of the row-sharded output projection."""

    def setup_cache(self, n_slots: int, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.register_buffer(
            "state", torch.zeros(n_slots, self.state_dim, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "intermediate",
            torch.zeros(n_slots, positions, self.state_dim, dtype=dtype, device=device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [B, S, D]
        decay = torch.sigmoid(self.w_decay(x))  # [B, S, C]
        update = self.w_in(x)
        gate = F.silu(self.w_gate(x))
        s = self.state[meta.slot_ids]  # [B, C]
        states = []
        for t in range(x.shape[1]):
            s = decay[:, t] * s + (1 - decay[:, t]) * update[:, t]
            states.append(s)
        hs = torch.stack(states, dim=1)  # [B, S, C]
        if meta.verify:
            self.intermediate[meta.slot_ids] = hs
        else:
            self.state[meta.slot_ids] = hs[:, -1]
        out = self.w_out(hs * gate)
        return self.reduce(out) if self.reduce is not None else out

    def commit(self, slot_ids: torch.Tensor, last: torch.Tensor) -> None:
        """Roll back past rejected drafts: keep the state after position ``last`` of the verify."""
        # slot_ids, last: [B]
        self.state[slot_ids] = self.intermediate[slot_ids, last]
