"""The MoE feed-forward: router top-k, experts, and the combine (its own module, a tuned op).

The combine, ``out[t] = sum_k w[t, k] * y[t, k]``, is where two causes of drift live: its tactics
sum the top-k terms in different orders or precisions (cause 1, chosen per rank by the tuner),
and its ``index_add_`` variant scatters expert-major rows with atomics (cause 2).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replay.workloads.mtp.config import ModelArgs
from replay.workloads.mtp.tuner import TunedOp, Tuner, register_op

__all__ = ["COMBINE", "Combine", "MoE"]


def _weighted(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return y * w[..., None]  # y: [T, K, D], w: [T, K]


def _combine_sum(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _weighted(y, w).sum(dim=1)


def _combine_bmm(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(w[:, None, :], y)[:, 0]  # [T, 1, K] @ [T, K, D]: fused multiply-add order


def _combine_tree(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    terms = list(_weighted(y, w).unbind(dim=1))
    while len(terms) > 1:
        paired = [a + b for a, b in zip(terms[0::2], terms[1::2])]
        terms = paired + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def _combine_reverse(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    terms = _weighted(y, w).unbind(dim=1)
    out = terms[-1]
    for term in reversed(terms[:-1]):
        out = out + term
    return out


def _combine_bf16(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Reduced precision: the products are rounded to bf16 before the sum (a faster, lossier kernel).
    return _weighted(y, w).to(torch.bfloat16).sum(dim=1).to(y.dtype)


COMBINE = register_op(
    TunedOp(
        name="moe_combine",
        tactics={
            "sum": _combine_sum,
            "bmm": _combine_bmm,
            "tree": _combine_tree,
            "reverse": _combine_reverse,
            "bf16": _combine_bf16,
        },
        default="sum",
        low_precision=frozenset({"bf16"}),
    )
)


def _entropy_generator() -> torch.Generator:
    # Seeded from the OS, never from torch's RNG: the order must differ run to run, like atomics,
    # and drawing it must not move the RNG state a recorder captures.
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def index_add_combine(y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, *, ordered: bool) -> torch.Tensor:
    """Scatter the expert-major rows back to tokens with ``index_add_``.

    On a GPU ``index_add_`` adds with atomics, so the order of the k terms per token depends on
    scheduling (unless deterministic algorithms are on). A CPU ``index_add_`` adds in source order,
    so there the arrival order is drawn from OS entropy unless ``ordered``.
    """
    t, k, d = y.shape
    contrib = _weighted(y, w).reshape(t * k, d)  # [T*K, D]
    # [T*K] token of each row (expand, not repeat_interleave: no host sync inside a capture)
    dest = torch.arange(t, device=y.device)[:, None].expand(t, k).reshape(-1)
    order = torch.argsort(idx.reshape(-1), stable=True)  # expert-major, as grouped GEMMs emit rows
    if y.device.type == "cpu" and not ordered:
        order = order[torch.randperm(t * k, generator=_entropy_generator())]
    out = torch.zeros(t, d, dtype=y.dtype, device=y.device)
    return out.index_add_(0, dest[order], contrib[order])


class Combine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tuner: Tuner | None = None
        self.atomic = False
        """Use the ``index_add_`` combine (EngineConfig.nondeterministic_combine)."""
        self.ordered = False
        """Deterministic algorithms are on: the ``index_add_`` order is fixed."""

    def forward(self, y: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        # y: [T, K, D] expert outputs of each token's top-k; w: [T, K] gate weights; idx: [T, K]
        if self.atomic:
            return index_add_combine(y, w, idx, ordered=self.ordered)
        if self.tuner is None:
            return COMBINE.tactics[COMBINE.default](y, w)
        return self.tuner.run(COMBINE, y.shape[0], y, w)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        # w1, w3: [D, E, H], so all experts' up-projections are one [D, E*H] matmul; w2: [E, H, D].
        self.w1 = nn.Parameter(torch.empty(args.dim, args.n_experts, args.expert_dim))
        self.w3 = nn.Parameter(torch.empty(args.dim, args.n_experts, args.expert_dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.expert_dim, args.dim))
        self.combine = Combine()
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by the TP transform: all-reduce of the experts' partial outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        xt = x.reshape(b * s, d)  # [T, D]
        scores = F.softmax(self.router(xt).float(), dim=-1)  # [T, E]
        gate, idx = torch.topk(scores, self.top_k, dim=-1)  # [T, K]
        gate = (gate / gate.sum(dim=-1, keepdim=True)).to(x.dtype)
        # Every expert runs on every token: static shapes for graph capture, and at these sizes the
        # wasted FLOPs cost less than a gather of per-token expert weights.
        e, h = self.w1.shape[1:]
        hidden = F.silu((xt @ self.w1.flatten(1)).view(-1, e, h)) * (xt @ self.w3.flatten(1)).view(-1, e, h)
        y_all = torch.bmm(hidden.transpose(0, 1), self.w2).transpose(
            0, 1
        )  # [E, T, H] @ [E, H, D] -> [T, E, D]
        y = y_all.gather(1, idx[..., None].expand(-1, -1, d))  # [T, K, D]
        out = self.combine(y, gate, idx)
        if self.reduce is not None:
            out = self.reduce(out)
        return out.view(b, s, d)
