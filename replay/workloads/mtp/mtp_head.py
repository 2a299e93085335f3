"""The MTP head: drafts the next token from the target's hidden state and the current token.

As in DeepSeek-V3 / Nemotron-H MTP, it shares the target's embedding, final norm and LM head, and
concatenates the normalised target hidden state with the normalised token embedding before a
projection and an MoE block (Nemotron-H's MTP pattern ``*E`` ends in one), initialised from the
target's last MoE layer. Applied k times it drafts k tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from replay.workloads.mtp.config import ModelArgs
from replay.workloads.mtp.moe import MoE
from replay.workloads.mtp.norm import RMSNorm

__all__ = ["MTPHead"]


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.embed_norm = RMSNorm(args.dim, args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args)

    def forward(self, hidden: torch.Tensor, tok_emb: torch.Tensor) -> torch.Tensor:
        # hidden: [B, D] target (or previous draft) hidden state; tok_emb: [B, D] -> [B, D]
        z = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(tok_emb)], dim=-1))
        return z + self.moe(self.ffn_norm(z)[:, None, :])[:, 0]
