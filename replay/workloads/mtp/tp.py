"""Tensor parallelism as a transform on the plain model (as gpt-fast's ``tp.py`` does).

Attention is split by heads, the recurrence by channels, the experts (the target's and the MTP
head's) by their hidden dim: each input projection is column-sharded, each output projection
row-sharded and followed by an all-reduce. Embedding, routers, norms, the MTP input projection and
the LM head stay replicated; they see the same (all-reduced) inputs on every rank, which is why TP
hides drift from the sharded parts. A replicated op that differs per rank (a forced ``lm_head``
tactic) still drifts under TP.
"""

from __future__ import annotations

import torch
from torch import nn

from replay.workloads.mtp.collectives import AllReduce
from replay.workloads.mtp.model import Transformer
from replay.workloads.mtp.moe import MoE

__all__ = ["apply_tp"]


def _shard(param: torch.Tensor, dim: int, rank: int, world: int) -> nn.Parameter:
    return nn.Parameter(param.detach().chunk(world, dim=dim)[rank].clone(), requires_grad=False)


def _check_divisible(model: Transformer, world: int) -> None:
    args = model.args
    for name, size in (
        ("n_heads", args.n_heads),
        ("state_dim", args.state_dim),
        ("expert_dim", args.expert_dim),
    ):
        if size % world:
            raise ValueError(f"tp layout over {world} ranks needs {name} ({size}) divisible by {world}")


@torch.no_grad()
def apply_tp(model: Transformer, *, rank: int, world_size: int, one_shot: bool) -> Transformer:
    """Keep this rank's shard of every sharded weight and install the all-reduces, in place."""
    if world_size == 1:
        return model
    _check_divisible(model, world_size)
    reduce = AllReduce(one_shot=one_shot)
    for attn in model.attention_layers():
        for lin in (attn.wq, attn.wk, attn.wv):
            lin.weight = _shard(lin.weight, 0, rank, world_size)  # [H*hd, D] by heads
        attn.wo.weight = _shard(attn.wo.weight, 1, rank, world_size)
        attn.n_heads //= world_size
        attn.reduce = reduce
    for rec in model.recurrent_layers():
        for lin in (rec.w_decay, rec.w_in, rec.w_gate):
            lin.weight = _shard(lin.weight, 0, rank, world_size)  # [C, D] by channels
        rec.w_decay.bias = _shard(rec.w_decay.bias, 0, rank, world_size)
        rec.w_out.weight = _shard(rec.w_out.weight, 1, rank, world_size)
        rec.state_dim //= world_size
        rec.reduce = reduce
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.w1 = _shard(moe.w1, 2, rank, world_size)  # [D, E, H]
        moe.w3 = _shard(moe.w3, 2, rank, world_size)
        moe.w2 = _shard(moe.w2, 1, rank, world_size)  # [E, H, D]
        moe.reduce = reduce
    return model
