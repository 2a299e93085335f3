"""What a recording session does when a graph is captured or replayed: graph ids, keys, and the
CPU (or custom) runners that have no CUDA graph. A part of ``Session`` (``replay.record.session``)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from replay.record.calls import Binder, call_key

__all__ = ["GraphEvents"]


class GraphEvents:
    """Graph ids and events; mixed into ``Session``, whose state (``_graph_counter``,
    ``_key_stack``, ``_cuda_graphs``, ``_cpu_graphs``, counters, ``recorder``) it uses."""

    _graph_counter: int
    _key_stack: list[tuple[str, tuple, int]]
    _cuda_graphs: Any
    _cpu_graphs: dict[tuple, int]
    _cuda_captures: int
    _cuda_replays: int
    _step_replays: int
    _tuner_dirty: bool
    recorder: Any
    ensure_recorder: Callable[[], Any]

    def _next_graph_id(self) -> int:
        gid = self._graph_counter
        self._graph_counter += 1
        return gid

    def current_graph_key(self) -> tuple[str, int]:
        if self._key_stack:
            key, ints, _ = self._key_stack[-1]
            return key, (ints[0] if len(ints) == 1 else -1)
        return f"graph{self._graph_counter}", -1

    def on_cuda_graph_captured(self, graph: Any, kernels: list[dict[str, Any]], pool: int) -> None:
        self._cuda_captures += 1
        self._tuner_dirty = True
        rec = self.ensure_recorder()
        if rec is None:
            return
        key, padded = self.current_graph_key()
        gid = self._next_graph_id()
        try:
            self._cuda_graphs[graph] = gid
        except TypeError:
            pass
        rec.record_graph(key, graph_id=gid, padded_size=padded, pool=pool, kernels=kernels, source="torch.cuda.CUDAGraph")

    def on_cuda_graph_replayed(self, graph: Any) -> None:
        self._cuda_replays += 1
        self._step_replays += 1
        gid = self._cuda_graphs.get(graph) if graph is not None else None
        if self.recorder is not None and gid is not None:
            self.recorder.record_graph_replay(gid)

    def _wrap_capture(self, fn: Callable[..., Any], target: str) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def capture_wrapper(*args: Any, **kwargs: Any) -> Any:
            key, ints = call_key(sig, args, kwargs)
            self._key_stack.append((key, ints, self._cuda_captures))
            ops: list[dict[str, Any]] | None = None
            try:
                if torch.cuda.is_available():
                    out = fn(*args, **kwargs)
                else:
                    from replay.record.cuda_graphs import OpLog

                    with OpLog() as oplog:
                        out = fn(*args, **kwargs)
                    ops = oplog.kernels
            finally:
                _, _, captures_before = self._key_stack.pop()
            if self._cuda_captures == captures_before:
                # A runner without a CUDA graph (on CPU, or a custom one): record it here, with
                # the operators it ran while capturing as its "kernels".
                rec = self.ensure_recorder()
                gid = self._next_graph_id()
                self._cpu_graphs[ints] = gid
                self._tuner_dirty = True
                if rec is not None:
                    rec.record_graph(key, graph_id=gid, padded_size=ints[0] if len(ints) == 1 else -1, kernels=ops or [], source=target)
            return out

        return capture_wrapper

    def _wrap_replay(self, fn: Callable[..., Any], target: str) -> Callable[..., Any]:
        sig = Binder(inspect.signature(fn))  # bound every step: planned once per call shape

        def replay_wrapper(*args: Any, **kwargs: Any) -> Any:
            before = self._cuda_replays
            out = fn(*args, **kwargs)
            if self._cuda_replays == before:
                _, ints = call_key(sig, args, kwargs)
                gid = self._cpu_graphs.get(ints)
                self._step_replays += 1
                if gid is not None and self.recorder is not None:
                    self.recorder.record_graph_replay(gid)
            return out

        return replay_wrapper
