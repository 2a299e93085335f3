"""The program's own frames: its traceback for an exception its step raised under the recorder,
and the function of the program that called the step.

A step's exception passes through the recorder's wrappers on its way out; printed as they are,
its traceback would hold four or five of the recorder's frames between the program's call and the
program's code. The wrapper that lets it out re-raises it with those frames left out, so the
program (and whoever reads its log) sees its own frames and the one wrapper frame that re-raised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable

__all__ = ["without_recorder_frames", "program_caller", "program_caller_frame"]

_RECORD_DIR = str(Path(__file__).resolve().parent) + "/"
_REPLAY_DIR = str(Path(__file__).resolve().parent.parent) + "/"
_TORCH_DIR = "/torch/"
_MAX_FRAMES = 64


def _stdlib_dirs() -> tuple[str, ...]:
    """Python's own library (a thread pool's worker, asyncio's task runner): never the program's
    caller of its step, which a user could record instead (its site-packages are: an engine
    installed there, as vLLM is, calls its model from there)."""
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")}
    return tuple(str(Path(d).resolve()) + "/" for d in dirs if d)


_STDLIB_DIRS = _stdlib_dirs()


def without_recorder_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the frames of ``replay/record/``: those before the program's (the step's
    wrappers) and those between its frames (a collective's wrapper the program called through);
    ``tb`` itself when every frame is the recorder's (an exception of the recorder's own, such
    as a lockstep divergence)."""
    kept = []
    node = tb
    while node is not None:
        if not node.tb_frame.f_code.co_filename.startswith(_RECORD_DIR):
            kept.append(node)
        node = node.tb_next
    if not kept:
        return tb
    try:
        for a, b in zip(kept, kept[1:]):
            if a.tb_next is not b:
                a.tb_next = b  # writable since Python 3.7
    except (AttributeError, TypeError, ValueError):
        pass  # left as it is: a longer traceback, never a lost one
    return kept[0]


def program_caller(module_name: Callable[[str], str], step: str) -> str | None:
    """``module:qualname`` of the program's innermost function on the stack that is not the step
    itself, torch's or replay's (``ModelRunner.execute_model`` calling ``model(...)``): what a
    user records instead when the step reads state its caller set outside its arguments (a
    global forward context). None at the top level of a script, or for a local function."""
    return program_caller_frame(module_name, step)[0]


def program_caller_frame(module_name: Callable[[str], str], step: str) -> tuple[str | None, FrameType | None]:
    """``program_caller``'s name and its frame: the same frame at two calls of the step is a
    function that runs the loop (``main``), not one call's caller."""
    return _caller(module_name, step, sys._getframe(1))


def _caller(module_name: Callable[[str], str], step: str, frame: FrameType | None) -> tuple[str | None, FrameType | None]:
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None, None
        code = frame.f_code
        path = code.co_filename
        if not (path.startswith(_REPLAY_DIR) or _TORCH_DIR in path or path.startswith("<") or _in_stdlib(path)):
            qual = getattr(code, "co_qualname", code.co_name)
            if qual == "<module>" or "<" in qual:
                return None, None
            name = f"{module_name(str(frame.f_globals.get('__name__', '?')))}:{qual}"
            if name != step and not step.endswith(f":{qual.rsplit('.', 1)[0]}"):
                return name, frame
        frame = frame.f_back
    return None, None


def _in_stdlib(path: str) -> bool:
    return path.startswith(_STDLIB_DIRS) and "/site-packages/" not in path and "/dist-packages/" not in path
