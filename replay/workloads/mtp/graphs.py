"""The bucketed static-buffer runner: CUDA graphs on a GPU, the same buffers and padding on CPU.

A batch of B rows runs under the graph of the smallest bucket >= B. Inputs are copied into static
buffers sized for the largest bucket; rows B..bucket-1 are padding and point at the dummy slot and
dummy page, so whatever they compute lands where no request reads it. Before each capture the
step runs ``warmup_iters`` times (on a side stream on CUDA) inside the tuner's `tuning()` scope:
that is when the per-rank autotuner times its tactics, as in TensorRT-LLM's torch-cudagraph backend.

On CPU there is no graph object, but the runner keeps the graph contract so CI exercises it: the
step runs on the static buffers, and host values the step takes (the ``kv_pages`` int) are the
ones seen at capture, exactly what a CUDA graph would have frozen.

Two hazards are bug switches: ``stale_padding`` skips the reset of padded rows (they keep zeros,
i.e. slot 0 and page 0 of a real request, or an earlier batch's rows), and ``bake_kv_len`` makes
the step read a host-computed page count that capture then freezes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from replay.workloads.mtp.tuner import Tuner

__all__ = ["INPUT_NAMES", "GraphRunner", "StepFn"]

log = logging.getLogger(__name__)

INPUT_NAMES = ("input_ids", "input_pos", "seq_lens", "page_table", "slot_ids")


class StepFn(Protocol):
    """The captured step: the five inputs of `INPUT_NAMES` in order, then a host ``kv_pages``."""

    def __call__(self, *inputs: torch.Tensor, kv_pages: int | None) -> tuple[torch.Tensor, ...]: ...


class GraphRunner:
    def __init__(
        self,
        fn: StepFn,
        *,
        buckets: tuple[int, ...],
        pages_per_seq: int,
        dummy_slot: int,
        dummy_page: int,
        device: torch.device,
        tuner: Tuner,
        warmup_iters: int,
        kv_pages_of: Callable[[torch.Tensor], int],
        stale_padding: bool = False,
        bake_kv_len: bool = False,
    ) -> None:
        self.fn = fn
        self.buckets = tuple(sorted(buckets))
        self.dummy_slot = dummy_slot
        self.dummy_page = dummy_page
        self.device = device
        self.tuner = tuner
        self.warmup_iters = warmup_iters
        self.kv_pages_of = kv_pages_of
        self.stale_padding = stale_padding
        self.bake_kv_len = bake_kv_len
        rows = self.buckets[-1]
        # Zero-initialised, as most runners allocate them: zeros are slot 0 and page 0, which
        # belong to a real request; only the padding reset keeps padded rows off them.
        self.static: dict[str, torch.Tensor] = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device=device),
            "input_pos": torch.zeros(rows, dtype=torch.int64, device=device),
            "seq_lens": torch.zeros(rows, dtype=torch.int64, device=device),
            "page_table": torch.zeros(rows, pages_per_seq, dtype=torch.int64, device=device),
            "slot_ids": torch.zeros(rows, dtype=torch.int64, device=device),
        }
        self.captured: dict[int, int | None] = {}
        """bucket -> the host ``kv_pages`` value the capture froze (None: capture-safe)."""
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"graphs.{name}": buf for name, buf in self.static.items()}

    def _views(self, bucket: int) -> list[torch.Tensor]:
        return [self.static[name][:bucket] for name in INPUT_NAMES]

    def _reset_padding(self, start: int, stop: int) -> None:
        if self.stale_padding or start >= stop:
            return
        self.static["input_ids"][start:stop] = 0
        self.static["input_pos"][start:stop] = 0
        self.static["seq_lens"][start:stop] = 0
        self.static["page_table"][start:stop] = self.dummy_page
        self.static["slot_ids"][start:stop] = self.dummy_slot

    def capture(self, bucket: int) -> None:
        """Warm up (the tuner times tactics here), then capture the step for ``bucket`` rows."""
        if bucket not in self.buckets:
            raise ValueError(f"no bucket {bucket}; buckets are {list(self.buckets)}")
        self._reset_padding(0, bucket)
        views = self._views(bucket)
        kv_pages = self.kv_pages_of(self.static["seq_lens"][:bucket]) if self.bake_kv_len else None
        if self.device.type == "cuda":
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self.tuner.tuning():
                for _ in range(self.warmup_iters):
                    self.fn(*views, kv_pages=kv_pages)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._outputs[bucket] = self.fn(*views, kv_pages=kv_pages)
            self._graphs[bucket] = graph
        else:
            with self.tuner.tuning():
                for _ in range(self.warmup_iters):
                    self.fn(*views, kv_pages=kv_pages)
        self.captured[bucket] = kv_pages
        log.debug("captured bucket %d (kv_pages=%s)", bucket, kv_pages)

    def replay(
        self,
        bucket: int,
        input_ids: torch.Tensor,
        input_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Copy the batch into the static buffers, pad to ``bucket``, run; outputs of the B real rows.

        On CUDA the outputs are views of the graph's static outputs: the next replay overwrites
        them, so a caller that keeps one must clone it.
        """
        if bucket not in self.captured:
            raise RuntimeError(f"bucket {bucket} has not been captured")
        batch = input_ids.shape[0]
        for name, value in zip(INPUT_NAMES, (input_ids, input_pos, seq_lens, page_table, slot_ids)):
            self.static[name][:batch].copy_(value)
        self._reset_padding(batch, bucket)
        if self.device.type == "cuda":
            self._graphs[bucket].replay()
            outputs = self._outputs[bucket]
        else:
            outputs = self.fn(*self._views(bucket), kv_pages=self.captured[bucket])
        return tuple(out[:batch] for out in outputs)
