"""A tiny GPT (nanoGPT shape: learned positions, LayerNorm, fused qkv, GELU MLP) whose forward
takes the KV cache as an argument: a list of per-layer (k, v) tensors owned by the caller.
Plain PyTorch; it knows nothing of replay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 80
    block_size: int = 48
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        k_cache[:, :, pos : pos + t] = k
        v_cache[:, :, pos : pos + t] = v
        keys, values = k_cache[:, :, : pos + t], v_cache[:, :, : pos + t]
        att = (q @ keys.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, pos + t, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ values).transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), pos, k_cache, v_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, pos: int, kv: list[torch.Tensor]) -> torch.Tensor:
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + t, device=idx.device))
        for i, block in enumerate(self.h):
            x = block(x, pos, kv[2 * i], kv[2 * i + 1])
        return self.lm_head(self.ln_f(x[:, -1:, :]))
