"""The plain (single-device, unsharded) hybrid model: attention / recurrent mixers, MoE FFNs,
final norm, LM head and MTP head. Tensor parallelism is applied to it afterwards by `tp.py`.

Submodule names are stable because debuggers tap them: ``layers.0.attn``, ``layers.0.moe``,
``layers.0.moe.combine``, ``layers.1.recurrent``, ``norm``, ``lm_head``, ``mtp``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replay.workloads.mtp.attention import Attention, ForwardMeta
from replay.workloads.mtp.config import ModelArgs
from replay.workloads.mtp.moe import MoE
from replay.workloads.mtp.mtp_head import MTPHead
from replay.workloads.mtp.norm import RMSNorm
from replay.workloads.mtp.recurrent import Recurrent
from replay.workloads.mtp.tuner import TunedOp, Tuner, register_op

__all__ = ["LM_HEAD", "Block", "LMHead", "Transformer", "init_weights"]


def _lm_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _lm_splitk(parts: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def tactic(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Split-K: partial products over slices of the hidden dim, summed afterwards.
        xs, ws = x.chunk(parts, dim=-1), w.chunk(parts, dim=-1)
        out = F.linear(xs[0], ws[0])
        for xi, wi in zip(xs[1:], ws[1:]):
            out = out + F.linear(xi, wi)
        return out

    return tactic


LM_HEAD = register_op(
    TunedOp(
        name="lm_head",
        tactics={"mm": _lm_mm, "splitk2": _lm_splitk(2), "splitk4": _lm_splitk(4)},
        default="mm",
    )
)


class LMHead(nn.Module):
    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.tuner: Tuner | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D] -> [..., V]
        flat = x.reshape(-1, x.shape[-1])
        if self.tuner is None:
            logits = LM_HEAD.tactics[LM_HEAD.default](flat, self.weight)
        else:
            logits = self.tuner.run(LM_HEAD, flat.shape[0], flat, self.weight)
        return logits.view(*x.shape[:-1], -1)


class Block(nn.Module):
    """Pre-norm residual block: an attention or recurrent mixer, then an MoE feed-forward."""

    def __init__(self, args: ModelArgs, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn: Attention | None = Attention(args) if kind == "a" else None
        self.recurrent: Recurrent | None = Recurrent(args) if kind == "r" else None
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args)

    @property
    def mixer(self) -> Attention | Recurrent:
        mixer = self.attn if self.attn is not None else self.recurrent
        assert mixer is not None
        return mixer

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        h = x + self.mixer(self.mixer_norm(x), meta)
        return h + self.moe(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, kind) for kind in args.layer_kinds)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = LMHead(args.dim, args.vocab_size)
        self.mtp = MTPHead(args)

    def blocks(self) -> list[Block]:
        return [layer for layer in self.layers if isinstance(layer, Block)]

    def attention_layers(self) -> list[Attention]:
        return [b.attn for b in self.blocks() if b.attn is not None]

    def recurrent_layers(self) -> list[Recurrent]:
        return [b.recurrent for b in self.blocks() if b.recurrent is not None]

    def setup_caches(
        self, *, n_pages: int, n_slots: int, verify_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        for attn in self.attention_layers():
            attn.setup_cache(n_pages, dtype, device)
        for rec in self.recurrent_layers():
            rec.setup_cache(n_slots, verify_len, dtype, device)

    def forward(self, tokens: torch.Tensor, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward. tokens: [B, S] -> (logits [B, S, V], pre-norm hidden [B, S, D])."""
        h = self.tok_embeddings(tokens)
        for block in self.blocks():
            h = block(h, meta)
        return self.lm_head(self.norm(h)), h

    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy MTP drafts. tokens: [B] last accepted token; hidden: [B, D] -> drafts [B, k]."""
        drafts = []
        for _ in range(k):
            hidden = self.mtp(hidden, self.tok_embeddings(tokens))
            tokens = self.lm_head(self.norm(hidden)).argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


def _generator(seed: int, name: str) -> torch.Generator:
    # Each parameter gets its own stream, so a tensor's values depend only on the seed and its
    # name: any rank can be rebuilt alone, and adding a parameter does not reshuffle the others.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


_OUTPUT_PROJECTIONS = ("attn.wo.", "recurrent.w_out.", "moe.w2")


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Draw every weight from ``seed`` (on CPU, so CPU and GPU builds hold the same values)."""
    args = model.args
    for name, p in model.named_parameters():
        g = _generator(seed, name)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if name == "tok_embeddings.weight":
            p.copy_(torch.randn(p.shape, generator=g))
            continue
        if name == "mtp.proj.weight":
            # Input = [norm(hidden); norm(embedding)]: mostly the embedding, a little context.
            ctx = torch.randn(args.dim, args.dim, generator=g) * (args.mtp_context_scale / args.dim**0.5)
            p.copy_(torch.cat([ctx, torch.eye(args.dim)], dim=1))
            continue
        if name.endswith("w_decay.bias"):
            p.fill_(2.0)  # decay ~0.88 per token: the state remembers a handful of tokens
            continue
        if name.startswith("mtp.moe."):
            continue  # copied from the last layer below
        if ".moe.w1" in name or ".moe.w3" in name:
            fan_in = p.shape[0]  # [D, E, H]
        elif ".moe.w2" in name:
            fan_in = p.shape[1]  # [E, H, D]
        else:
            fan_in = p.shape[-1]  # nn.Linear / nn.Embedding: [out, in]
        std = fan_in**-0.5
        if name == f"layers.{args.n_layers - 1}.moe.w2":
            std *= args.final_moe_scale
        elif any(tag in name for tag in _OUTPUT_PROJECTIONS):
            std *= args.residual_scale
        p.copy_(torch.randn(p.shape, generator=g) * std)
    # The MTP head starts as a copy of the last MoE layer, so its drafts imitate the target's
    # per-token computation and acceptance is high where context matters little.
    model.mtp.moe.load_state_dict(model.blocks()[-1].moe.state_dict())
