"""Top-k sampling with a tiny GPT, nanoGPT / gpt-fast style: `python generate.py [options]`.

A `Generator` owns the model, the KV cache (a list of tensors, one k and one v per layer), the
position (a Python int) and a seeded `torch.Generator`; `Generator.decode_step` runs one token
under `@torch.inference_mode()`. Prints one line `tokens: ...`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from model import GPT, GPTConfig


class Generator:
    def __init__(self, model: GPT, *, batch: int, max_seq: int, top_k: int, temperature: float, seed: int) -> None:
        c = model.config
        self.model = model
        self.top_k = top_k
        self.temperature = temperature
        shape = (batch, c.n_head, max_seq, c.n_embd // c.n_head)
        self.kv = [torch.zeros(shape) for _ in range(2 * c.n_layer)]
        self.pos = 0
        self.rng = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, -1, :] / self.temperature
        v, _ = torch.topk(logits, self.top_k)
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=self.rng)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        logits = self.model(prompt, self.pos, self.kv)
        self.pos += prompt.size(1)
        return self.sample(logits)

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor) -> torch.Tensor:
        logits = self.model(token, self.pos, self.kv)
        self.pos += 1
        return self.sample(logits)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", default="5,17,2,40")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig()).eval()
    prompt = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    gen = Generator(model, batch=1, max_seq=prompt.size(1) + args.tokens + 1, top_k=args.top_k,
                    temperature=args.temperature, seed=args.seed)
    tok = gen.prefill(prompt)
    out = [int(tok)]
    while len(out) < args.tokens:
        tok = gen.decode_step(tok)
        out.append(int(tok))
    print("tokens: " + " ".join(map(str, out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
