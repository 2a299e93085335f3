"""Greedy (optionally speculative) decoding with the tiny model: `python generate.py [options]`.

A plain script in the shape of public decode loops (gpt-fast): the decode step is the module-level
function `decode_one_token`, compiled with `torch.compile(fullgraph=True)` under `--compile`; the
decode loop runs inside `torch.nn.attention.sdpa_kernel(...)`; `--draft` adds a smaller draft
model for speculative decoding; under `torchrun --nproc-per-node N` the model is tensor-parallel
(gloo on CPU, plain tensors, forward hooks that all-reduce the row-parallel outputs).

Prints one line `tokens: ...` with the generated ids (rank 0 only).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import Transformer, build_model


def prefill(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    logits = model(x, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True)


def decode_one_token(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True), logits


def model_forward(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(x, input_pos)


def decode_n_tokens(model: Transformer, cur: torch.Tensor, input_pos: torch.Tensor, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        with sdpa_kernel([SDPBackend.MATH]):
            cur, _logits = decode_one_token(model, cur, input_pos)
        input_pos = input_pos + 1
        out.append(cur.clone())
    return out


def speculative_decode(model: Transformer, draft: Transformer, cur: torch.Tensor, input_pos: torch.Tensor, k: int) -> list[torch.Tensor]:
    """k draft tokens, verified by one target forward; greedy acceptance (same output as greedy)."""
    draft_tokens = decode_n_tokens(draft, cur, input_pos, k)
    seq = torch.cat([cur] + draft_tokens, dim=1)
    positions = torch.arange(int(input_pos[0]), int(input_pos[0]) + k + 1, device=cur.device)
    target = model_forward(model, seq, positions)[0].argmax(-1)  # (k+1,)
    proposed = torch.cat(draft_tokens, dim=1)[0]
    agree = (target[:k] == proposed).tolist()
    n = agree.index(False) if False in agree else k
    accepted = [proposed[i].view(1, 1) for i in range(n)] + [target[n].view(1, 1)]
    if n == k:
        # The last draft token was never fed to the draft model: do it so its cache is complete.
        decode_one_token(draft, draft_tokens[-1], input_pos + k)
    return accepted


def tensor_parallel(model: Transformer) -> None:
    """All-reduce the outputs of the row-parallel linears (attention `wo`, MLP `w2`) in hooks."""
    import torch.distributed as dist

    def all_reduce(_m: torch.nn.Module, _inp: tuple, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)
        return out

    for block in model.layers:
        block.attention.wo.register_forward_hook(all_reduce)
        block.feed_forward.w2.register_forward_hook(all_reduce)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    p.add_argument("--prompt", default="3,14,15,92,65", help="comma-separated prompt ids")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true", help="torch.compile(decode_one_token, fullgraph=True)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (e.g. reduce-overhead)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: Dynamo only, fast)")
    p.add_argument("--draft", action="store_true", help="speculative decoding with a draft model")
    p.add_argument("--speculate-k", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=rank, world_size=world)
    device = torch.device(args.device)
    model = build_model("tiny", seed=args.seed, world=world, rank=rank).to(device).eval()
    if world > 1:
        tensor_parallel(model)
    prompt = torch.tensor([[int(t) for t in args.prompt.split(",")]], device=device)
    max_seq = prompt.size(1) + args.tokens + args.speculate_k + 2
    model.setup_caches(1, max_seq)
    model.to(device)
    draft = None
    if args.draft:
        draft = build_model("draft", seed=args.seed + 1).to(device).eval()
        draft.setup_caches(1, max_seq)
        draft.to(device)

    global decode_one_token
    if args.compile:
        decode_one_token = torch.compile(decode_one_token, fullgraph=True, mode=args.compile_mode, backend=args.compile_backend)

    generated: list[int] = []
    with torch.no_grad():
        pos = torch.arange(prompt.size(1), device=device)
        cur = prefill(model, prompt, pos)
        if draft is not None:
            prefill(draft, prompt, pos)
        generated.append(int(cur))
        input_pos = torch.tensor([prompt.size(1)], device=device)
        while len(generated) < args.tokens:
            if draft is None:
                new = decode_n_tokens(model, cur, input_pos, 1)
            else:
                new = speculative_decode(model, draft, cur, input_pos, args.speculate_k)
            input_pos = input_pos + len(new)
            cur = new[-1]
            generated.extend(int(t) for t in new)
    generated = generated[: args.tokens]
    if rank == 0:
        print("tokens: " + " ".join(map(str, generated)), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
