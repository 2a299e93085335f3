"""A small nn.Module decode loop recorded twice, once with one weight changed: the subject of
``replay bisect layers --between run:A,run:B`` (tests/test_bisect_across_runs.py).

``python -m tests.runs_engine STEPS BUMP``: ``BUMP`` is added to ``block.mix.weight[3, 5]`` (the
config says so, so that a re-run rebuilds the weights that ran). The step's state, ``kv``, carries
over from one step to the next. The re-run option ``raise=1`` (``--set raise=1``) makes every step
raise, which no recording did.
"""

from __future__ import annotations

import sys

import torch

D, V = 8, 16


class Block(torch.nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.mix = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.mix.weight.copy_(torch.randn(D, D, generator=g) / D**0.5)
            self.mix.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mix(self.norm(h)))


class Net(torch.nn.Module):
    """embed -> block (norm, mix) -> head; its forward is the recorded step."""

    def __init__(self, bump: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.bump, self.seed = float(bump), seed
        self.embed = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(D, D, generator=g) / D**0.5)
            self.embed.bias.zero_()
        self.block = Block(g)
        self.head = torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(V, D, generator=g) / D**0.5)
            self.block.mix.weight[3, 5] += self.bump
        self.register_buffer("kv", torch.zeros(2, D))
        self.fail = False

    def replay_state(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv}

    def replay_config(self) -> dict:
        return {"bump": self.bump, "seed": self.seed}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("planted failure")
        with torch.no_grad():
            h = self.block(self.embed(x) + self.kv)
            self.kv.copy_(h)
            return self.head(h)


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> Net:
    cfg = config or {}
    net = Net(float(cfg.get("bump", 0.0)), int(cfg.get("seed", 0)))
    net.fail = bool(options.get("raise"))
    return net


def build_base(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> Net:
    """A factory that loads one fixed model whatever the run (a user's that reads one checkpoint)."""
    return Net()


def main(steps: int, bump: float) -> None:
    net = Net(bump)
    for pos in range(steps):
        net(torch.full((2, D), float(pos + 1) / steps))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
