"""The model: a Hugging Face Llama scaled down, random weights from a seed, nothing downloaded.

Sizes are named presets (``tiny`` for CPU tests, ``small`` for a GPU). Tensor parallelism is a
transform applied to the plain model with ``torch.distributed.tensor.parallel``, as torch's own
recipes do it: attention and MLP projections sharded column-wise then row-wise, one all-reduce
after each, embeddings, norms and the LM head replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Preset", "PRESETS", "make_model", "apply_tensor_parallel"]


@dataclass(frozen=True, slots=True)
class Preset:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_len: int  # positions of the static KV cache


PRESETS: dict[str, Preset] = {
    # A few hundred KB of weights: a CPU test decodes a step in milliseconds.
    "tiny": Preset(vocab=96, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, max_len=32),
    # ~170M parameters: big enough that kernels, split-K and collectives look like a real model's.
    "small": Preset(vocab=8192, hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, max_len=256),
}


def llama_config(preset: Preset, attn: str = "sdpa"):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=preset.vocab,
        hidden_size=preset.hidden,
        intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.max_len,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return cfg


def make_model(preset: Preset, *, seed: int, dtype: torch.dtype, device: str, attn: str = "sdpa") -> torch.nn.Module:
    """A ``LlamaForCausalLM`` with weights drawn from ``seed``: the same bits on every rank."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(llama_config(preset, attn))
    # Initialised on the CPU and then moved, so every device and every rank holds the same bits.
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def apply_tensor_parallel(model: torch.nn.Module, world_size: int, device: str) -> None:
    """Shard ``model`` over a 1-D mesh of ``world_size`` ranks (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world_size,))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        # src_data_rank=None: every rank built the same weights from the seed, so each keeps its
        # own shard and set-up needs no scatter (a weight perturbed on one rank stays perturbed).
        parallelize_module(layer, mesh, plan, src_data_rank=None)
