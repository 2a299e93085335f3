"""A tiny causal LM in the shape of Hugging Face transformers' (legacy cache API): `model(input_ids,
past_key_values=..., use_cache=True)` returns a dataclass output whose `past_key_values` is a
tuple of per-layer `(key, value)` tuples, concatenated anew every step (new tensors, growing
shapes). Plain PyTorch; it knows nothing of replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    torch_dtype: str = "float32"


@dataclass
class CausalLMOutputWithPast:
    logits: torch.Tensor
    past_key_values: Optional[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = None
    hidden_states: Optional[torch.Tensor] = None


class TinyAttention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.h = c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.o_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, past: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.h, d // self.h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None and t > 1)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class TinyDecoderLayer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size)
        self.self_attn = TinyAttention(c)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 2 * c.hidden_size), nn.SiLU(), nn.Linear(2 * c.hidden_size, c.hidden_size))

    def forward(self, x: torch.Tensor, past: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a, present = self.self_attn(self.input_layernorm(x), past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class TinyForCausalLM(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = None,
        use_cache: bool = True,
        return_dict: bool = True,
    ) -> CausalLMOutputWithPast | tuple:
        x = self.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, past_key_values[i] if past_key_values is not None else None)
            presents.append(present)
        logits = self.lm_head(self.norm(x)).float()
        pkv = tuple(presents) if use_cache else None
        if not return_dict:
            return (logits, pkv)
        return CausalLMOutputWithPast(logits=logits, past_key_values=pkv)
