"""Greedy generation in the shape of a Hugging Face transformers loop: `python generate.py [options]`.

`model(input_ids, attention_mask=..., past_key_values=past, use_cache=True)` each step, under
`torch.no_grad()` and bfloat16 autocast; the cache is the tuple of tuples the model returns (new
tensors every step). `--tuple` asks for tuple outputs (`return_dict=False`); `--compile forward|method`
compiles the model's own call (`model.forward = torch.compile(model.forward)`, `model.compile()`).
Prints `tokens: ...`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from modeling import TinyConfig, TinyForCausalLM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", default="1,9,33,7,12")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--tuple", action="store_true", help="return_dict=False (tuple outputs)")
    p.add_argument("--no-autocast", action="store_true")
    p.add_argument("--compile", choices=["none", "forward", "method"], default="none",
                   help="forward: model.forward = torch.compile(model.forward); method: model.compile()")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--exit-code", type=int, default=0, help="exit with this status after printing (as a failing job would)")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = TinyForCausalLM(TinyConfig()).eval()
    if args.compile == "forward":
        model.forward = torch.compile(model.forward, backend=args.compile_backend, dynamic=True)
    elif args.compile == "method":
        model.compile(backend=args.compile_backend, dynamic=True)
    input_ids = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    attention_mask = torch.ones_like(input_ids)
    past = None
    generated: list[int] = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_autocast):
        for _ in range(args.tokens):
            out = model(input_ids, attention_mask=attention_mask, past_key_values=past, use_cache=True, return_dict=not args.tuple)
            logits, past = (out.logits, out.past_key_values) if not args.tuple else out
            next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            generated.append(int(next_token))
            input_ids = next_token
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=1)
    print("tokens: " + " ".join(map(str, generated)), flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
