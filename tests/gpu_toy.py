"""A small engine that captures its decode step in a torch.cuda.CUDAGraph by hand (GPU tests)."""

from __future__ import annotations

import sys

import torch

B, D, V = 4, 256, 1000


class GraphedEngine:
    def __init__(self, config: dict, device: str = "cuda") -> None:
        self.config = dict(config)
        g = torch.Generator(device="cpu").manual_seed(int(config.get("seed", 0)))
        self.w1 = (torch.randn(D, D, generator=g) / D**0.5).to(device)
        self.head = torch.randn(D, V, generator=g).to(device)
        self.emb = torch.randn(V, D, generator=g).to(device)
        self.hidden = torch.zeros(B, D, device=device)
        self.static_tokens = torch.zeros(B, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_logits: torch.Tensor | None = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"hidden": self.hidden}

    def replay_config(self) -> dict:
        return self.config

    def replay_toggles(self) -> dict[str, list]:
        return {"cudagraph": [False, True]}

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden * 0.5 + self.emb[tokens] @ self.w1)
        self.hidden.copy_(h)
        return h @ self.head

    def capture(self) -> None:
        saved = self.hidden.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._forward(self.static_tokens)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_logits = self._forward(self.static_tokens)
        self.hidden.copy_(saved)

    def step(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.graph is None:
            logits = self._forward(tokens)
        else:
            self.static_tokens.copy_(tokens)
            self.graph.replay()
            logits = self.static_logits.clone()
        return {"logits": logits, "tokens": logits.argmax(-1)}


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> GraphedEngine:
    eng = GraphedEngine(config, device)
    if options.get("cudagraph"):
        eng.capture()
    return eng


class PlainEngine(GraphedEngine):
    """The same engine with no graph runner of its own: replay graphs its step (GraphedStep)."""

    def replay_toggles(self) -> dict[str, list]:
        return {}


def build_plain(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> PlainEngine:
    return PlainEngine(config, device)


def main(argv: list[str]) -> None:
    steps = int(argv[0])
    eng = GraphedEngine({"seed": 0})
    eng.capture()
    tokens = torch.arange(B, device="cuda")
    for _ in range(steps):
        tokens = eng.step(tokens)["tokens"]
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
