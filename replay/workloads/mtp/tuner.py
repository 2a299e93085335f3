"""A per-rank autotuner: the first cause of rank drift.

Tuned ops (the MoE combine, the LM-head matmul) have several tactics that compute the same sum in a
different order or precision. While the graph runner warms up before a capture, the tuner times
each tactic on the real inputs of that shape and keeps the fastest, the way TensorRT-LLM's
AutoTuner does inside ``_capture_one_graph``. In ``independent`` mode every rank times on its own,
so timing noise gives ranks different winners and different bits. ``broadcast`` mode lets rank 0
decide and broadcasts the choice (the fix). Forced tactics override both, per rank, for tests and
for re-running a recorded rank with its recorded winners.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from replay.workloads.mtp import collectives

__all__ = ["TunedOp", "Tuner", "register_op", "tuned_ops"]

log = logging.getLogger(__name__)

Tactic = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class TunedOp:
    name: str
    tactics: Mapping[str, Tactic]
    default: str
    low_precision: frozenset[str] = frozenset()
    """Tactics the tuner only times when `EngineConfig.tuner_low_precision` is on."""


_REGISTRY: dict[str, TunedOp] = {}


def register_op(op: TunedOp) -> TunedOp:
    if op.default not in op.tactics:
        raise ValueError(f"default tactic {op.default!r} of {op.name!r} is not one of its tactics")
    _REGISTRY[op.name] = op
    return op


def tuned_ops() -> dict[str, TunedOp]:
    return dict(_REGISTRY)


def _split_key(key: str) -> str:
    """``moe_combine.m16`` -> ``moe_combine``; a bare op name stays as it is."""
    return key.split(".m", 1)[0] if ".m" in key else key


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Tuner:
    """Chooses a tactic per (op, rows) and remembers it; profiles only inside `tuning()`."""

    def __init__(
        self,
        mode: str,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        forced: Mapping[str, str] | None = None,
        low_precision: bool = False,
        reps: int = 5,
    ) -> None:
        self.mode = mode
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.low_precision = low_precision
        self.reps = reps
        self.forced: dict[str, str] = dict(forced or {})
        self.cache: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self._active = False
        for key, tactic in self.forced.items():
            op = _REGISTRY.get(_split_key(key))
            if op is None:
                raise ValueError(
                    f"cannot force {key!r}: no tuned op of that name; tuned ops are {sorted(_REGISTRY)}"
                )
            if tactic not in op.tactics:
                raise ValueError(
                    f"cannot force {key!r} to {tactic!r}; tactics of {op.name} are {sorted(op.tactics)}"
                )

    @contextlib.contextmanager
    def tuning(self) -> Iterator[None]:
        """Profile unseen shapes while inside (the graph runner's warm-up)."""
        previous, self._active = self._active, self.mode != "off"
        try:
            yield
        finally:
            self._active = previous

    def run(self, op: TunedOp, rows: int, *args: torch.Tensor) -> torch.Tensor:
        return op.tactics[self.choose(op, rows, args)](*args)

    def choose(self, op: TunedOp, rows: int, args: tuple[torch.Tensor, ...]) -> str:
        key = f"{op.name}.m{rows}"
        forced = self.forced.get(key) or self.forced.get(op.name)
        if forced is not None:
            return forced
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not self._active or capturing:
            return op.default
        tactic = self._decide(op, key, args)
        self.cache[key] = tactic
        return tactic

    def _decide(self, op: TunedOp, key: str, args: tuple[torch.Tensor, ...]) -> str:
        names = [n for n in op.tactics if self.low_precision or n not in op.low_precision]
        if self.mode == "broadcast" and self.world_size > 1:
            # Only rank 0's clock counts; every rank reaches this point in the same order because
            # warm-up runs the same shapes everywhere.
            index = names.index(self._profile(op, key, names, args)) if self.rank == 0 else 0
            index = collectives.broadcast_int(index, src=0, device=self.device)
            return names[index]
        return self._profile(op, key, names, args)

    def _profile(self, op: TunedOp, key: str, names: list[str], args: tuple[torch.Tensor, ...]) -> str:
        times: dict[str, float] = {}
        for name in names:
            fn = op.tactics[name]
            fn(*args)
            _sync(self.device)
            start = time.perf_counter()
            for _ in range(self.reps):
                fn(*args)
            _sync(self.device)
            times[name] = (time.perf_counter() - start) / self.reps
        self.timings[key] = times
        best = min(names, key=times.__getitem__)
        log.debug("rank %d tuned %s -> %s (%s)", self.rank, key, best, times)
        return best

    def choices(self) -> dict[str, str]:
        """Forced entries plus every tuned (op, rows) winner; passing this back as forced
        tactics makes a rebuilt engine compute what this rank computed."""
        return {**self.cache, **self.forced}
