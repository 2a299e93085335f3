"""Speculative decoding run by a wrapper module: `python generate.py [options]`.

`SpeculativeEngine.forward` (called once) runs the loop; every model call goes through the
helper `next_token(model, tokens)`; the draft is a smaller `TinyLM` (same class as the target).
`--compile` compiles both models as modules: `torch.compile(model, dynamic=False)`.
Prints `tokens: ...`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nets import SpeculativeEngine, TinyLM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--prompt", default="4,8,15,16,23,42")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-backend", default="inductor")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    target = TinyLM(vocab=50, dim=32, n_layer=2).eval()
    draft = TinyLM(vocab=50, dim=16, n_layer=1).eval()
    if args.compile:
        target = torch.compile(target, dynamic=False, backend=args.compile_backend)
        draft = torch.compile(draft, dynamic=False, backend=args.compile_backend)
    engine = SpeculativeEngine(target, draft, k=args.k)
    prompt = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    with torch.no_grad():
        out = engine(prompt, args.tokens)
    print("tokens: " + " ".join(str(int(t)) for t in out[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
