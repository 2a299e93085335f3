"""A step's record work on the device, captured once per step signature as a CUDA graph.

The side stream's work of a recorded step (``replay.record.staging``) digests the step's
snapshots and takes the top-2 margin of its logits: about a dozen kernels, each a host launch.
When the snapshots are static buffers (``Staging.snapshot``), that work reads and writes the same
addresses every step of one signature (same tensors, shapes and dtypes), so it is captured once,
on the side stream, and replayed: one launch. Its results land in one small device buffer, the
*tail* (the digests as int64, then the margin as float32), copied to the host in one transfer.

The first sightings of a signature run the work eagerly (which also compiles the Triton digest
kernel before any capture); a signature seen ``CAPTURE_AFTER`` times is captured. A capture that
fails turns plans off for the recorder: the eager path is always there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from replay.digest import digest_into
from replay.record.margin import device_margin

__all__ = ["SidePlans", "CAPTURE_AFTER", "MAX_PLANS"]

CAPTURE_AFTER = 3
MAX_PLANS = 16
# A captured graph keeps its temporaries (the margin's masked copy of the logits among them) for
# as long as it lives: captured plans hold at most this much device memory together, counted as
# twice their inputs' bytes; beyond, a signature's work runs eagerly.
MAX_PLAN_BYTES = 256 << 20


@dataclass(slots=True)
class _Plan:
    tail: torch.Tensor  # int64 [n + 1]: the digests, then the margin's float32 bits in the low half
    graph: Any = None
    seen: int = 0


def _key(digests: list[torch.Tensor], logits: torch.Tensor | None) -> tuple:
    # Static inputs are buffers their owner keeps, never resized: the objects and their
    # addresses name them (a key of shapes and strides costs tens of µs of Python a step).
    return (*((id(t), t.data_ptr()) for t in digests), (id(logits), logits.data_ptr()) if logits is not None else None)


def _work(tail: torch.Tensor, digests: list[torch.Tensor], logits: torch.Tensor | None) -> None:
    """What one replay does: digests into the tail's first slots, the margin into its last."""
    for i, t in enumerate(digests):
        digest_into(t, tail, i)
    if logits is not None:
        tail[len(digests) :].view(torch.float32)[:1].copy_(device_margin(logits))


class SidePlans:
    """The captured record work of each step signature of one recorder (on its side stream)."""

    def __init__(self) -> None:
        self.plans: dict[tuple, _Plan] = {}
        self.enabled = True
        self.captured = 0
        self.held_bytes = 0  # the captured plans' estimated device memory
        self.failure: str | None = None  # why plans were turned off

    def run(self, digests: list[torch.Tensor], logits: torch.Tensor | None, *, static: bool) -> torch.Tensor:
        """Queue the work on the current (side) stream; returns the tail (int64 [n + 1]).
        ``static``: the inputs are buffers kept (alive, unresized) from step to step."""
        key = _key(digests, logits) if static and self.enabled else None
        plan = self.plans.get(key) if key is not None else None
        if plan is None:
            dev = (digests[0] if digests else logits).device  # type: ignore[union-attr]
            with torch.inference_mode(False):  # kept: written in place by steps in and out of inference mode
                plan = _Plan(tail=torch.zeros(len(digests) + 1, dtype=torch.int64, device=dev))
            if key is not None and len(self.plans) < MAX_PLANS:
                self.plans[key] = plan
        if plan.graph is not None:
            plan.graph.replay()
            return plan.tail
        plan.seen += 1
        if key is not None and plan.seen == CAPTURE_AFTER and key in self.plans and self._fits(digests, logits):
            self._capture(plan, digests, logits)
            if plan.graph is not None:
                plan.graph.replay()
                return plan.tail
        _work(plan.tail, digests, logits)
        return plan.tail

    def _fits(self, digests: list[torch.Tensor], logits: torch.Tensor | None) -> bool:
        """Room for one more captured plan (counted if so)."""
        need = 2 * sum(t.numel() * t.element_size() for t in [*digests, *([logits] if logits is not None else [])])
        if self.held_bytes + need > MAX_PLAN_BYTES:
            return False
        self.held_bytes += need
        return True

    def _capture(self, plan: _Plan, digests: list[torch.Tensor], logits: torch.Tensor | None) -> None:
        cls = torch.cuda.CUDAGraph
        # The recorder's own graphs are not the program's: the class's unpatched methods.
        begin, end = getattr(cls, "__replay_orig__", (cls.capture_begin, cls.capture_end, cls.replay))[:2]
        try:
            g = cls()
            # thread_local: the program's threads may use CUDA while this stream captures.
            begin(g, capture_error_mode="thread_local")
            try:
                _work(plan.tail, digests, logits)
            finally:
                end(g)
            if getattr(cls, "__replay_keeps__", False):
                g.instantiate()
        except Exception as e:  # noqa: BLE001 - the eager path stays
            self.enabled = False
            self.failure = f"{e.__class__.__name__}: {e}"
            self.plans.clear()
            return
        orig_replay = getattr(cls, "__replay_orig__", (None, None, cls.replay))[2]
        plan.graph = _OwnGraph(g, orig_replay)
        self.captured += 1


class _OwnGraph:
    """A captured graph replayed through the unpatched ``replay`` (not recorded as the program's)."""

    __slots__ = ("graph", "_replay")

    def __init__(self, graph: Any, replay: Any) -> None:
        self.graph = graph
        self._replay = replay

    def replay(self) -> None:
        self._replay(self.graph)
