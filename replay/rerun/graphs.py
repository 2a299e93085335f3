"""``--mode cudagraph`` for a target without a graph runner of its own: graph the step itself.

The step is captured once per input signature (shapes and dtypes), after a warm-up on a side
stream, with its inputs copied into static buffers, as an engine would. Warm-up and capture run
the step, which changes the target's state, so state is saved before and restored after.
"""

from __future__ import annotations

from typing import Any

import torch

from replay.rerun.target import Target

__all__ = ["GraphedStep"]


def _signature(kwargs: dict[str, Any]) -> tuple:
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)) for k, v in sorted(kwargs.items())
    )


class GraphedStep:
    def __init__(self, target: Target, warmup: int = 2) -> None:
        self.target = target
        self.warmup = warmup
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, Any], Any]] = {}

    def _capture(self, kwargs: dict[str, Any]) -> tuple[torch.cuda.CUDAGraph, dict[str, Any], Any]:
        saved = self.target.snapshot()
        static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                self.target.step_fn(**static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self.target.step_fn(**static)
        torch.cuda.synchronize()
        if saved:
            self.target.load_state(saved)
        return g, static, out

    def __call__(self, **kwargs: Any) -> Any:
        sig = _signature(kwargs)
        if sig not in self._graphs:
            self._graphs[sig] = self._capture(kwargs)
        g, static, out = self._graphs[sig]
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        g.replay()
        return out
