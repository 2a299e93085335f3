"""Attention over a paged KV cache, and the per-forward metadata every mixer reads."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from replay.workloads.mtp.config import ModelArgs

__all__ = ["Attention", "ForwardMeta", "KVCache"]


class ForwardMeta(NamedTuple):
    """Where the tokens of one forward sit: the same for every layer of that forward."""

    input_pos: torch.Tensor
    """[B, S] position of each token."""
    page_table: torch.Tensor
    """[B, P] page of the pool holding positions [p*page_size, (p+1)*page_size) of each row."""
    slot_ids: torch.Tensor
    """[B] recurrent-state slot of each row."""
    verify: bool
    """True for a decode verify over k+1 positions (the recurrent layer keeps every intermediate
    state so rejected drafts can be rolled back); False for prefill (commit the last state)."""
    kv_pages: int | None = None
    """Pages attention reads per row; None reads the whole page table (capture-safe). An int is a
    host value: under a CUDA graph it is frozen at capture (the baked-value hazard)."""


class KVCache(nn.Module):
    """A pool of pages shared by all requests; the last page is the dummy page padded rows use.

    Heads lead (``[H, pages, page_size, hd]``) so that the pages gathered for a batch are already
    laid out as ``[H, B, L, hd]`` for the attention matmuls, without another copy.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor

    def __init__(self, n_pages: int, page_size: int, n_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (n_heads, n_pages, page_size, head_dim)
        self.register_buffer("k_pages", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_pages", torch.zeros(shape, dtype=dtype), persistent=False)

    def write(self, page: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # page, offset: [B, S]; k, v: [B, S, H, hd]
        self.k_pages[:, page, offset] = k.permute(2, 0, 1, 3)
        self.v_pages[:, page, offset] = v.permute(2, 0, 1, 3)

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pages: [B, n] -> keys, values: [H, B, n * page_size, hd]
        return self.k_pages[:, pages].flatten(2, 3), self.v_pages[:, pages].flatten(2, 3)


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, hd]; pos: [B, S]; inv_freq: [hd/2]
    angles = pos.to(torch.float32)[..., None] * inv_freq  # [B, S, hd/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.head_dim
        self.page_size = args.page_size
        inner = args.n_heads * args.head_dim
        self.wq = nn.Linear(args.dim, inner, bias=False)
        self.wk = nn.Linear(args.dim, inner, bias=False)
        self.wv = nn.Linear(args.dim, inner, bias=False)
        self.wo = nn.Linear(inner, args.dim, bias=False)
        inv_freq = 1.0 / (
            args.rope_base ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.kv_cache: KVCache | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by the TP transform: all-reduce of the row-sharded output projection."""

    def setup_cache(self, n_pages: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv_cache = KVCache(n_pages, self.page_size, self.n_heads, self.head_dim, dtype).to(device)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        assert self.kv_cache is not None, "setup_caches() must run before a forward"
        b, s, _ = x.shape
        pos = meta.input_pos  # [B, S]
        q = _rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), pos, self.inv_freq)
        k = _rope(self.wk(x).view(b, s, self.n_heads, self.head_dim), pos, self.inv_freq)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim)

        page = meta.page_table.gather(1, pos // self.page_size)  # [B, S]
        self.kv_cache.write(page, pos % self.page_size, k, v)

        n_pages = meta.page_table.shape[1] if meta.kv_pages is None else meta.kv_pages
        keys, values = self.kv_cache.read(meta.page_table[:, :n_pages])  # [H, B, L, hd]
        key_pos = torch.arange(keys.shape[2], device=x.device)  # [L]
        visible = key_pos[None, None, :] <= pos[:, :, None]  # [B, S, L]

        qh = q.permute(2, 0, 1, 3).float()  # [H, B, S, hd]
        scores = qh @ keys.float().transpose(-1, -2) / math.sqrt(self.head_dim)  # [H, B, S, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = F.softmax(scores, dim=-1)
        out = (probs @ values.float()).to(x.dtype)  # [H, B, S, hd]
        out = self.wo(out.permute(1, 2, 0, 3).reshape(b, s, self.n_heads * self.head_dim))
        return self.reduce(out) if self.reduce is not None else out
