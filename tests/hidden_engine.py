"""A one-rank engine whose numerics depend on something its recorded config does not say: the
``HIDDEN_DOUBLE`` environment variable of the recorded process. A re-run without it does not
reproduce the recording; the ``double`` toggle it declares restores what the variable did. The
subject of ``replay bisect config --criterion reproduce`` (tests/test_bisect.py)."""

from __future__ import annotations

import os
import sys

import torch

B, D, V = 2, 8, 16


class HiddenEngine:
    def __init__(self, config: dict, *, double: bool = False) -> None:
        self.config = dict(config)
        g = torch.Generator().manual_seed(int(config.get("seed", 0)))
        self.emb = torch.randn(V, D, generator=g)
        self.head = torch.randn(D, V, generator=g)
        self.hidden = torch.zeros(B, D)
        self.double = double or bool(os.environ.get("HIDDEN_DOUBLE"))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"hidden": self.hidden}

    def replay_config(self) -> dict:
        return self.config

    def replay_toggles(self) -> dict[str, list]:
        return {"double": [False, True], "seed_offset": [0, 1]}

    def step(self, tokens: torch.Tensor, pos: int) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.hidden * 0.5 + self.emb[tokens]) * (2.0 if self.double else 1.0)
        self.hidden.copy_(h)
        logits = h @ self.head
        return {"logits": logits, "tokens": logits.argmax(-1)}


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> HiddenEngine:
    return HiddenEngine(config, double=bool(options.get("double", False)))


def main(argv: list[str]) -> None:
    eng = HiddenEngine({"seed": 0})
    tokens = torch.arange(B) % V
    for pos in range(int(argv[0])):
        tokens = eng.step(tokens, pos)["tokens"]


if __name__ == "__main__":
    main(sys.argv[1:])
