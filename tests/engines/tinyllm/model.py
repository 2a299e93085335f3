"""A tiny llama-like decoder (embedding, attention + MLP blocks with a KV-cache buffer, RMSNorm,
rotary embeddings), in the shape of small public decode loops such as gpt-fast. Plain PyTorch:
it knows nothing of replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    dim: int = 32
    intermediate_size: int = 64
    max_seq_length: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


PRESETS = {
    "tiny": ModelArgs(),
    "draft": ModelArgs(n_layer=1, dim=16, n_head=2, intermediate_size=32),
}


class KVCache(nn.Module):
    def __init__(self, batch: int, n_heads: int, max_seq: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (batch, n_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: Tensor, freqs: Tensor) -> Tensor:
    # x: (b, s, h, d); freqs: (s, d/2, 2)
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1], xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, n_local_heads: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_local_heads, a.head_dim
        self.wqkv = nn.Linear(a.dim, 3 * n_local_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(n_local_heads * a.head_dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, freqs: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split(self.n_head * self.head_dim, dim=-1)
        q = rope(q.view(b, s, self.n_head, self.head_dim), freqs)
        k = rope(k.view(b, s, self.n_head, self.head_dim), freqs)
        v = v.view(b, s, self.n_head, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        assert self.kv_cache is not None, "call setup_caches first"
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs, local_inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, local_inter, bias=False)
        self.w3 = nn.Linear(a.dim, local_inter, bias=False)
        self.w2 = nn.Linear(local_inter, a.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, world: int) -> None:
        super().__init__()
        self.attention = Attention(a, a.n_head // world)
        self.feed_forward = FeedForward(a, a.intermediate_size // world)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x: Tensor, freqs: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs, world: int = 1) -> None:
        super().__init__()
        self.config = config
        self.max_seq_length = config.max_seq_length
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, world) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        hd = config.head_dim
        inv = 1.0 / (config.rope_base ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(config.max_seq_length).float(), inv)
        self.register_buffer("freqs_cis", torch.stack([ang.cos(), ang.sin()], -1), persistent=False)
        self.register_buffer(
            "causal_mask", torch.tril(torch.ones(config.max_seq_length, config.max_seq_length, dtype=torch.bool)), persistent=False
        )

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        self.max_seq_length = max_seq_length
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, b.attention.n_head, max_seq_length, self.config.head_dim, self.output.weight.dtype)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        mask = self.causal_mask[None, None, input_pos, : self.max_seq_length]
        freqs = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, freqs, mask, input_pos)
        return self.output(self.norm(x))


def build_model(name: str, *, seed: int, world: int = 1, rank: int = 0) -> Transformer:
    """Random weights drawn from ``seed`` on the CPU; with ``world`` > 1 this rank keeps its shard."""
    torch.manual_seed(seed)
    full = Transformer(PRESETS[name])
    with torch.no_grad():
        for pname, p in full.named_parameters():
            if not pname.endswith("norm.weight"):
                p.normal_(0.0, 1.0 if "embeddings" in pname else 0.25)
    if world == 1:
        return full
    model = Transformer(PRESETS[name], world=world)
    sd = full.state_dict()
    local = {}
    for k, t in model.state_dict().items():
        src = sd[k]
        if src.shape == t.shape:
            local[k] = src
        elif k.endswith("wqkv.weight"):
            qkv = src.chunk(3, 0)
            local[k] = torch.cat([q.chunk(world, 0)[rank] for q in qkv], 0)
        elif src.shape[0] != t.shape[0]:
            local[k] = src.chunk(world, 0)[rank]  # column parallel: w1, w3
        else:
            local[k] = src.chunk(world, 1)[rank]  # row parallel: wo, w2
    model.load_state_dict(local)
    return model
