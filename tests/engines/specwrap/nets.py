"""A tiny decoder (GRU-free, MLP-mixer-ish over a fixed window) and a wrapper module that runs
the whole speculative decoding loop in its own forward. Plain PyTorch; knows nothing of replay."""

from __future__ import annotations

import torch
import torch.nn as nn

WINDOW = 4

class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Next-token logits from a window of the last ``window`` tokens (embedding sum + layers);
    a running state buffer (``memory``) carries the last hidden state from step to step."""

    def __init__(self, vocab: int, dim: int, n_layer: int, window: int = WINDOW) -> None:
        super().__init__()
        self.window = window
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(n_layer))
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("memory", torch.zeros(1, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens[:, -self.window :]).mean(1) + 0.5 * torch.tanh(self.memory)
        for layer in self.layers:
            x = layer(x)
        self.memory.copy_(x.detach())
        return self.head(x)


def next_token(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The helper every model call goes through (the engine's one place that calls a model)."""
    # A fixed window: every call has the same shapes (one graph under torch.compile(dynamic=False)).
    return model(tokens[:, -WINDOW:].flatten().view(tokens.size(0), WINDOW)).argmax(-1, keepdim=True)


class SpeculativeEngine(nn.Module):
    """Holds the target and the draft; its forward runs the whole generation (called once)."""

    def __init__(self, target: nn.Module, draft: nn.Module, k: int) -> None:
        super().__init__()
        self.target = target
        self.draft = draft
        self.k = k

    def forward(self, prompt: torch.Tensor, n_tokens: int) -> torch.Tensor:
        tokens = prompt
        while tokens.size(1) - prompt.size(1) < n_tokens:
            proposal = tokens
            for _ in range(self.k):
                proposal = torch.cat([proposal, next_token(self.draft, proposal)], dim=1)
            verified = next_token(self.target, tokens)
            # Greedy acceptance against the target: keep the target's token (always correct).
            accept = bool((proposal[:, tokens.size(1)] == verified[:, 0]).all())
            tokens = torch.cat([tokens, verified if not accept else proposal[:, tokens.size(1) : tokens.size(1) + 1]], dim=1)
        return tokens[:, prompt.size(1) : prompt.size(1) + n_tokens]
