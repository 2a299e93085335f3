"""A one-rank engine whose re-runs can be made to fail on purpose: the subject of verdict tests.

``Engine.step`` (a method, built by ``build``) and ``Tiny`` (an nn.Module class recorded as its
``forward``, built by ``build_tiny``). Re-run options (``--set``) plant failures that a recording
never had: ``raise_at=N`` raises from step N on, ``rename=1`` returns the output under another
name. ``python -m tests.rerun_engine STEPS [none]``: ``none`` makes every step return None.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

D, V = 8, 16


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g), torch.randn(D, V, generator=g) / D**0.5


class Engine:
    def __init__(self, config: dict, options: dict | None = None) -> None:
        self.config = dict(config)
        self.options = dict(options or {})
        self.emb, self.head = _weights(int(config.get("seed", 0)))
        self.model = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.model.weight.copy_(torch.eye(D) * 0.5)
            self.model.bias.zero_()
        self.hidden = torch.zeros(2, D)
        # Python-side step state, as engines keep it (a counter): it changes what a step computes,
        # so a re-run that restores the tensors but not the counter departs.
        self.steps_done = 0

    def state(self) -> dict[str, torch.Tensor]:
        return {"hidden": self.hidden}

    def replay_config(self) -> dict:
        return self.config

    def step(self, tokens: torch.Tensor, pos: int) -> Any:
        raise_at = self.options.get("raise_at")
        if raise_at is not None and pos >= int(raise_at):
            raise RuntimeError(f"planted failure at step {pos}")
        with torch.no_grad():
            h = torch.tanh(self.model(self.hidden) + self.emb[tokens])
        self.hidden.copy_(h)
        # The program runs its loop under sdpa_kernel([MATH]) (flash off): a step that reads the
        # flag computes other bits when the re-run does not restore that context.
        logits = h @ self.head + (0.0 if torch.backends.cuda.flash_sdp_enabled() else 0.5) + 1e-3 * self.steps_done
        self.steps_done += 1
        if self.config.get("none"):
            return None
        return {"other": logits} if self.options.get("rename") else {"logits": logits}


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> Engine:
    return Engine(config, options)


class Tiny(torch.nn.Module):
    """An nn.Module whose forward is the step; its buffer ``kv`` carries over between steps."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Linear(D, D)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(D, D, generator=g) / D**0.5)
            self.proj.bias.zero_()
        self.register_buffer("kv", torch.zeros(2, D))

    def replay_state(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv}

    def replay_config(self) -> dict:
        return {"seed": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = torch.tanh(self.proj(x) + self.kv)
            self.kv.copy_(h)
        return h @ torch.ones(D, V)


def build_tiny(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> Tiny:
    return Tiny(int((config or {}).get("seed", 0)))


def main(steps: int, none: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    eng = Engine({"seed": 3, "none": none})
    tiny = Tiny(0)
    tokens = torch.tensor([1, 2])
    with sdpa_kernel([SDPBackend.MATH]):
        for pos in range(steps):
            out = eng.step(tokens, pos)
            if out is not None:
                tokens = out["logits"].argmax(-1)
            tiny(torch.full((2, D), float(pos) / steps))


if __name__ == "__main__":
    main(int(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "none")
