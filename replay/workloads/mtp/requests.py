"""Host-side bookkeeping of the batch: requests, their slots, pages and positions.

None of this changes numerics: it only decides which tensors `Engine.decode_step` receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PagePool", "Request", "make_prompt"]


@dataclass(slots=True)
class Request:
    slot: int
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    pos: int = 0
    """Position of ``next_token``: tokens before it are in the KV cache."""
    next_token: int = 0
    generated: list[int] = field(default_factory=list)


class PagePool:
    """Free list of KV pages; the last page is reserved as the dummy page for padded rows."""

    def __init__(self, n_pages: int) -> None:
        self.dummy = n_pages - 1
        self._free = list(range(n_pages - 2, -1, -1))  # pop() hands out page 0 first

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("KV page pool exhausted")
        return self._free.pop()

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def make_prompt(seed: int, index: int, *, vocab_size: int, min_len: int, max_len: int) -> list[int]:
    """Prompt number ``index`` of a run: depends only on the seed, so every rank draws the same."""
    g = torch.Generator().manual_seed(seed * 7919 + index + 1)
    length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()
