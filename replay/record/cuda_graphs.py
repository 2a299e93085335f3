"""CUDA graph instrumentation: every capture (with the kernels inside it) and every replay.

Kernels are read from the graph itself: capture runs in CUDA graph debug mode and the graph is
dumped as DOT after capture, which lists each kernel node's function and launch dimensions.
On machines without CUDA, runners that stand in for graphs are described by the operators they
ran while capturing (``OpLog``).

With no step named, a graph the program captured around a module call and then replays is a
step candidate: each replay outside a step is recorded as that module's call (``discovery``).
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["install", "parse_dot_kernels", "OpLog"]

_DIM = r"\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)"


def _dims(text: str) -> list[int]:
    """``{2,2}`` or ``64`` -> [2, 2, 1] / [64, 1, 1]."""
    nums = [int(x) for x in re.findall(r"\d+", text)][:3]
    return (nums + [1, 1, 1])[:3] if nums else [0, 0, 0]


def _split_launch(inner: str) -> list[str]:
    """Top-level comma split of ``{2,2},64,6528`` -> ['{2,2}', '64', '6528']."""
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_dot_kernels(dot: str) -> list[dict[str, Any]]:
    """Kernel nodes of a ``cudaGraphDebugDotPrint`` dump, in node order: name, grid, block.

    A verbose dump labels each kernel node ``{KERNEL | {ID | 0 (topoId: 2) | name<<<grid,block,
    shared>>>} | ...}`` (with DOT escapes), grid and block being ``{x,y}`` or a single number.
    """
    kernels = []
    for m in re.finditer(r'"graph_\d+_node_(\d+)"\s*\[(.*?)\];\s*$', dot, flags=re.S | re.M):
        body = m.group(2).replace("\\", "")
        if "KERNEL" not in body:
            continue
        launch = re.search(r"\|\s*([^|{}]*?)<<<(.*?)>>>", body, flags=re.S)
        if launch:
            name = launch.group(1).strip()
            parts = _split_launch(launch.group(2))
            grid = _dims(parts[0]) if parts else [0, 0, 0]
            block = _dims(parts[1]) if len(parts) > 1 else [0, 0, 0]
        else:
            sym = re.search(r"(_Z\w+|\w+_kernel\w*)", body)
            name, grid, block = (sym.group(1) if sym else "kernel"), [0, 0, 0], [0, 0, 0]
        kernels.append({"name": name, "grid": grid, "block": block, "node": int(m.group(1))})
    kernels.sort(key=lambda k: k["node"])
    for k, name in zip(kernels, demangle_all([k["name"] for k in kernels])):
        k.pop("node")
        k["name"] = name
    return kernels


def _demangle(name: str) -> str:
    return name.strip().strip('"')


def demangle_all(names: list[str]) -> list[str]:
    """C++ kernel names demangled with ``c++filt`` when it is installed (one process for all)."""
    mangled = [n for n in names if n.startswith("_Z")]
    if not mangled:
        return names
    import shutil
    import subprocess

    tool = shutil.which("c++filt")
    if tool is None:
        return names
    try:
        p = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True, timeout=10)
        out = p.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return names
    if len(out) != len(mangled):
        return names
    table = dict(zip(mangled, out))
    return [table.get(n, n) for n in names]


def graph_kernels(graph: Any) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(suffix=".dot", prefix="replay-graph-")
    os.close(fd)
    try:
        with warnings.catch_warnings():
            # torch announces every dump with a warning; the program's output is not ours to fill.
            warnings.simplefilter("ignore")
            graph.debug_dump(path)
        with open(path, errors="replace") as fh:
            text = fh.read()
        if os.environ.get("REPLAY_KEEP_GRAPH_DOT"):
            with open(os.environ["REPLAY_KEEP_GRAPH_DOT"], "a") as fh:
                fh.write(text)
        return parse_dot_kernels(text)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def install(session: Any, module: Any) -> None:
    """Patch ``torch.cuda.graphs.CUDAGraph`` (construction, capture_begin, capture_end, replay).

    To read the kernels back after capture, the graph must outlive its instantiation: on torch
    versions with ``keep_graph``, graphs are built with it and instantiated right after capture
    (as capture_end would have done), unless the program asked to keep the graph itself. Older
    versions use the debug mode.
    """
    cls = module.CUDAGraph
    if getattr(cls, "__replay_patched__", False):
        return
    orig_begin, orig_end, orig_replay = cls.capture_begin, cls.capture_end, cls.replay
    try:
        has_keep = "keep_graph" in inspect.signature(cls.__new__).parameters
    except (TypeError, ValueError):
        has_keep = False
    wants_kernels = bool(session.settings.cuda_graph_kernels)

    if has_keep and wants_kernels:
        orig_init = cls.__init__

        def __init__(self: Any, keep_graph: bool = False, *args: Any, **kwargs: Any) -> None:
            orig_init(self, True, *args, **kwargs)
            try:
                self.__replay_user_keeps__ = bool(keep_graph)
            except AttributeError:
                pass

        cls.__init__ = __init__

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        if wants_kernels and not has_keep and not session.disabled:
            try:
                self.enable_debug_mode()
            except Exception:  # noqa: BLE001
                pass
        out = orig_begin(self, *args, **kwargs)
        if getattr(session, "_discover", False) and not session.disabled:
            _watch_capture(self)
        return out

    def capture_end(self: Any) -> Any:
        try:
            out = orig_end(self)
        finally:
            _end_capture(self)
        kernels: list[dict[str, Any]] = []
        if wants_kernels and not session.disabled:
            try:
                kernels = graph_kernels(self)
            except Exception as e:  # noqa: BLE001
                session.warn_once("dot", f"cannot list the kernels of captured CUDA graphs ({e})")
        if has_keep and wants_kernels and not getattr(self, "__replay_user_keeps__", True):
            self.instantiate()  # what capture_end does when the program did not ask to keep the graph
        try:
            pool = hash(tuple(self.pool())) & 0x7FFFFFFFFFFFFFFF
        except Exception:  # noqa: BLE001
            pool = -1
        try:
            session.on_cuda_graph_captured(self, kernels, pool)
        except Exception as e:  # noqa: BLE001
            session.warn_once("capture", f"cannot record a CUDA graph capture ({e})")
        return out

    def plain_replay(self: Any) -> Any:
        out = orig_replay(self)
        try:
            session.on_cuda_graph_replayed(self)
        except Exception as e:  # noqa: BLE001
            session.warn_once("replay", f"cannot record a CUDA graph replay ({e})")
        return out

    def replay(self: Any) -> Any:
        call = _captured_call(self) if getattr(session, "_discover", False) else None
        if call is None or getattr(session._local, "depth", 0) or session.disabled:
            return plain_replay(self)
        from replay.record.discovery import graph_replay_step

        return graph_replay_step(session, call, lambda: plain_replay(self))

    cls.capture_begin, cls.capture_end, cls.replay = capture_begin, capture_end, replay
    cls.__replay_patched__ = True
    # For the recorder's own graphs (``side_plan``): the unpatched methods, and whether a graph
    # made here must be instantiated after capture (the patched constructor keeps graphs).
    cls.__replay_orig__ = (orig_begin, orig_end, orig_replay)
    cls.__replay_keeps__ = has_keep and wants_kernels


class _CaptureWatch:
    """The outermost ``nn.Module`` call made while a graph is captured (hooks installed for the
    capture only): its arguments are the graph's static inputs, its result the static outputs,
    so each replay of the graph is a call of that module with what those tensors hold then."""

    def __init__(self) -> None:
        self.depth = 0
        self.call: tuple[Any, tuple, dict, Any] | None = None
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._pre),
                        register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def _pre(self, _m: Any, _args: Any) -> None:
        self.depth += 1

    def _post(self, m: Any, args: Any, kwargs: Any, out: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.call is None:
            self.call = (m, tuple(args), dict(kwargs or {}), out)

    def stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_watching: dict[int, _CaptureWatch] = {}
_calls: "weakref.WeakKeyDictionary[Any, tuple[Any, tuple, dict, Any]]" = weakref.WeakKeyDictionary()


def _watch_capture(graph: Any) -> None:
    try:
        _watching[id(graph)] = _CaptureWatch()
    except Exception:  # noqa: BLE001 - only discovery through this graph is lost
        pass


def _end_capture(graph: Any) -> None:
    watch = _watching.pop(id(graph), None)
    if watch is None:
        return
    watch.stop()
    if watch.call is not None:
        try:
            _calls[graph] = watch.call
        except TypeError:
            pass


def _captured_call(graph: Any) -> tuple[Any, tuple, dict, Any] | None:
    try:
        return _calls.get(graph)
    except TypeError:
        return None


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
