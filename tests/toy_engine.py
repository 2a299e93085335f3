"""A toy multi-rank engine used as a recording subject in tests (not written for replay).

Each step mixes the previous hidden state with the input embedding, all-reduces across ranks
(so it has collectives), and returns logits and the argmax tokens, which the loop feeds back.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

B, D, V = 3, 16, 32


class ToyEngine:
    def __init__(self, config: dict, rank: int, world_size: int, device: str = "cpu") -> None:
        self.config = dict(config)
        self.rank, self.world = rank, world_size
        g = torch.Generator().manual_seed(int(config.get("seed", 0)))
        self.emb = torch.randn(V, D, generator=g).to(device)
        self.w = (torch.randn(D, D, generator=g) / D**0.5).to(device)
        self.head = torch.randn(D, V, generator=g).to(device)
        self.hidden = torch.zeros(B, D, device=device)
        self.noise = torch.zeros(B, D, device=device)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"hidden": self.hidden}

    def replay_config(self) -> dict:
        return self.config

    def step(self, tokens: torch.Tensor, pos: int) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.hidden * 0.5 + self.emb[tokens] @ self.w)
        if self.config.get("use_rng"):
            h = h + 1e-3 * torch.randn(h.shape, device=h.device)
        if self.world > 1:
            dist.all_reduce(h)
            h = h / self.world
        bad_rank, bad_at = self.config.get("perturb_rank"), self.config.get("perturb_at", 0)
        if bad_rank == self.rank and pos >= bad_at:
            h = h + 1e-3  # this rank computes something slightly different from here on
        self.hidden.copy_(h)
        logits = h @ self.head
        return {"logits": logits, "tokens": logits.argmax(-1)}


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> ToyEngine:
    cfg = dict(config)
    cfg.update({k: v for k, v in options.items() if k in ("perturb_rank", "perturb_at", "seed")})
    return ToyEngine(cfg, rank, world_size, device)


def _run(rank: int, world: int, port: int, steps: int, config: dict) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234 + rank * 0)
    eng = ToyEngine(config, rank, world)
    tokens = torch.arange(B) % V
    for pos in range(steps):
        tokens = eng.step(tokens, pos)["tokens"]
    if world > 1:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    import json
    import socket

    world, steps = int(argv[0]), int(argv[1])
    config = json.loads(argv[2]) if len(argv) > 2 else {"seed": 0}
    if world == 1:
        _run(0, 1, 0, steps, config)
        return
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    torch.multiprocessing.spawn(_run, args=(world, port, steps, config), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])
