"""``--mode cudagraph`` for a target without a graph runner of its own: graph the step itself.

The step is captured once per input signature (shapes and dtypes), after a warm-up on a side
stream, with its inputs copied into static buffers, as an engine would. Warm-up and capture run
the step, which changes the target's state, so state is saved before and restored after.

Tensors inside the arguments' lists, tuples and dicts (a KV cache passed as a list) get static
buffers too: a graph captured on the first call's tensors would otherwise read them on every
replay. After a replay, what the step wrote into its arguments is copied back into the caller's
tensors, as the eager call would have left them: a step that returns nothing and writes its
logits into an ``out=`` buffer is compared on what it wrote, not on the buffer it was given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from replay.rerun.target import Target

__all__ = ["GraphedStep"]


def _leaf_key(v: Any) -> tuple:
    """What a captured graph depends on in one argument: a tensor's shape, dtype and device; a
    scalar's value (baked into the graph); any other object's identity (its tensors' addresses)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device)
    if v is None or isinstance(v, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return ("value", repr(v))
    return ("object", id(v))


def _signature(leaves: list[Any], spec: Any) -> tuple:
    return (str(spec), tuple(_leaf_key(v) for v in leaves))


def _static(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


class GraphedStep:
    def __init__(self, target: Target, warmup: int = 2) -> None:
        self.target = target
        self.warmup = warmup
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = {}

    def _capture(self, leaves: list[Any], spec: Any) -> tuple[torch.cuda.CUDAGraph, list[Any], Any]:
        saved = self.target.snapshot()
        static = [_static(v) for v in leaves]
        kwargs = pytree.tree_unflatten(static, spec)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                self.target.step_fn(**kwargs)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self.target.step_fn(**kwargs)
        torch.cuda.synchronize()
        if saved:
            self.target.load_state(saved)
        return g, static, out

    def __call__(self, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten(kwargs)
        sig = _signature(leaves, spec)
        if sig not in self._graphs:
            self._graphs[sig] = self._capture(leaves, spec)
        g, static, out = self._graphs[sig]
        pairs = [(s, v) for s, v in zip(static, leaves) if isinstance(v, torch.Tensor)]
        with torch.no_grad():
            for s, v in pairs:
                s.copy_(v)
            g.replay()
            for s, v in pairs:
                _write_back(v, s)
        return out


def _write_back(caller: torch.Tensor, static: torch.Tensor) -> None:
    """The static buffer's values into the caller's tensor, as an in-place eager step leaves it.
    A tensor whose elements share memory (an ``expand``ed one) cannot be written in place, by the
    eager step either: the step only read it. Any other failure is the step's to report."""
    if torch._debug_has_internal_overlap(caller) == _OVERLAPS:
        return
    caller.copy_(static)


_OVERLAPS = 1  # at::MemOverlap::Yes
