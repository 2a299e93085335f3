"""Host-side bookkeeping of the batch: requests, their slots, KV pages and positions.

None of this changes numerics: it only decides which tensors `Engine.decode_step` receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from replay.workloads.mtp.config import EngineConfig, ModelArgs

__all__ = ["PagePool", "Request", "Scheduler", "StepInputs", "make_prompt"]


class StepInputs(NamedTuple):
    input_ids: torch.Tensor
    """[B] int64: the last accepted token of each request (not yet in the cache)."""
    input_pos: torch.Tensor
    """[B] int64: its position."""
    seq_lens: torch.Tensor
    """[B] int64: tokens already in the KV cache (equal to input_pos)."""
    page_table: torch.Tensor
    """[B, pages_per_seq] int64: KV pages of each request; unused entries hold the dummy page."""
    slot_ids: torch.Tensor
    """[B] int64: recurrent-state / MTP-hidden slot of each request."""


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


class Scheduler:
    """The running requests: one slot each, pages on demand, prompts drawn from the seed."""

    def __init__(self, config: EngineConfig, args: ModelArgs) -> None:
        self.config = config
        self.args = args
        self.pages = PagePool(config.batch * args.pages_per_seq + 1)
        self.requests: list[Request] = []
        self.prompts_drawn = 0

    def next_prompt(self) -> list[int]:
        self.prompts_drawn += 1
        return make_prompt(
            self.config.seed,
            self.prompts_drawn - 1,
            vocab_size=self.args.vocab_size,
            min_len=self.config.prompt_len_min,
            max_len=self.config.prompt_len_max,
        )

    def restart(self, req: Request) -> None:
        """Free the request's pages and give it a fresh prompt (it must be prefilled again)."""
        self.pages.give_back(req.pages)
        req.pages, req.generated, req.prompt = [], [], self.next_prompt()

    def page_table(self, reqs: list[Request], *, upto: list[int]) -> torch.Tensor:
        """[len(reqs), pages_per_seq]: pages covering positions < ``upto`` of each request."""
        table = torch.full((len(reqs), self.args.pages_per_seq), self.pages.dummy, dtype=torch.int64)
        for row, (req, end) in enumerate(zip(reqs, upto)):
            while len(req.pages) * self.args.page_size < end:
                req.pages.append(self.pages.take())
            table[row, : len(req.pages)] = torch.tensor(req.pages, dtype=torch.int64)
        return table

    def step_inputs(self, k: int, device: torch.device) -> StepInputs:
        reqs = self.requests
        pos = torch.tensor([r.pos for r in reqs], dtype=torch.int64)
        return StepInputs(
            input_ids=torch.tensor([r.next_token for r in reqs], dtype=torch.int64).to(device),
            input_pos=pos.to(device),
            seq_lens=pos.clone().to(device),
            page_table=self.page_table(reqs, upto=[r.pos + k + 1 for r in reqs]).to(device),
            slot_ids=torch.tensor([r.slot for r in reqs], dtype=torch.int64).to(device),
        )

    def advance(self, accepted: list[int], tokens: list[list[int]]) -> list[list[int]]:
        """Positions move by the accepted count; returns the tokens each request emitted."""
        emitted = []
        for req, n, row in zip(self.requests, accepted, tokens):
            req.generated.extend(row[:n])
            req.pos += n
            req.next_token = row[n - 1]
            emitted.append(row[:n])
        return emitted
