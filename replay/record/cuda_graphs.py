"""CUDA graph instrumentation: every capture (with the kernels inside it) and every replay.

Kernels are read from the graph itself: capture runs in CUDA graph debug mode and the graph is
dumped as DOT after capture, which lists each kernel node's function and launch dimensions.
On machines without CUDA, runners that stand in for graphs are described by the operators they
ran while capturing (``OpLog``).
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["install", "parse_dot_kernels", "OpLog"]

_DIM = r"\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)"


def parse_dot_kernels(dot: str) -> list[dict[str, Any]]:
    """Kernel nodes of a ``cudaGraphDebugDotPrint`` dump, in node order: name, grid, block."""
    kernels = []
    # One node per `"graph_X_node_Y" [ ... label="..." ]` statement.
    for m in re.finditer(r'"graph_\d+_node_(\d+)"\s*\[(.*?)\];?\s*$', dot, flags=re.S | re.M):
        body = m.group(2)
        if "KERNEL" not in body:
            continue
        name = None
        nm = re.search(r"\|\s*\{?\s*(?:name|func|function)\s*\|\s*([^|}]+)", body)
        if nm:
            name = nm.group(1).strip()
        if not name:
            sym = re.search(r"(_Z\w+|void\s+[\w:<>, ]+\()", body)
            name = sym.group(1) if sym else "kernel"
        dims = re.findall(_DIM, body)
        grid = [int(x) for x in dims[0]] if dims else [0, 0, 0]
        block = [int(x) for x in dims[1]] if len(dims) > 1 else [0, 0, 0]
        kernels.append({"name": _demangle(name.replace("\\l", "").replace("\\", "")), "grid": grid, "block": block, "node": int(m.group(1))})
    kernels.sort(key=lambda k: k["node"])
    for k in kernels:
        k.pop("node")
    return kernels


def _demangle(name: str) -> str:
    name = name.strip().strip('"')
    if not name.startswith("_Z"):
        return name
    try:
        import cxxfilt  # type: ignore[import-not-found]

        return cxxfilt.demangle(name)
    except Exception:  # noqa: BLE001 - mangled names still identify the kernel
        return name


def graph_kernels(graph: Any) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(suffix=".dot", prefix="replay-graph-")
    os.close(fd)
    try:
        graph.debug_dump(path)
        with open(path, errors="replace") as fh:
            return parse_dot_kernels(fh.read())
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def install(session: Any, module: Any) -> None:
    """Patch ``torch.cuda.graphs.CUDAGraph`` (capture_begin, capture_end, replay)."""
    cls = module.CUDAGraph
    if getattr(cls, "__replay_patched__", False):
        return
    orig_begin, orig_end, orig_replay = cls.capture_begin, cls.capture_end, cls.replay

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        if session.settings.cuda_graph_kernels and not session.disabled:
            try:
                self.enable_debug_mode()
            except Exception:  # noqa: BLE001
                pass
        return orig_begin(self, *args, **kwargs)

    def capture_end(self: Any) -> Any:
        out = orig_end(self)
        try:
            kernels = graph_kernels(self) if session.settings.cuda_graph_kernels else []
        except Exception as e:  # noqa: BLE001
            session.warn_once("dot", f"cannot list the kernels of captured CUDA graphs ({e})")
            kernels = []
        try:
            pool = hash(tuple(self.pool())) & 0x7FFFFFFFFFFFFFFF
        except Exception:  # noqa: BLE001
            pool = -1
        try:
            session.on_cuda_graph_captured(self, kernels, pool)
        except Exception as e:  # noqa: BLE001
            session.warn_once("capture", f"cannot record a CUDA graph capture ({e})")
        return out

    def replay(self: Any) -> Any:
        out = orig_replay(self)
        try:
            session.on_cuda_graph_replayed(self)
        except Exception as e:  # noqa: BLE001
            session.warn_once("replay", f"cannot record a CUDA graph replay ({e})")
        return out

    cls.capture_begin, cls.capture_end, cls.replay = capture_begin, capture_end, replay
    cls.__replay_patched__ = True


class OpLog(TorchDispatchMode):
    """The aten operators run inside a block, with their output shapes: a CPU runner's 'kernels'."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        shape = list(first.shape) if isinstance(first, torch.Tensor) else []
        self.kernels.append({"name": f"{func}", "grid": (shape + [0, 0, 0])[:3], "block": [0, 0, 0]})
        return out
