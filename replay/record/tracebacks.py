"""The program's own traceback for an exception its step raised under the recorder.

A step's exception passes through the recorder's wrappers on its way out; printed as they are,
its traceback would hold four or five of the recorder's frames between the program's call and the
program's code. The wrapper that lets it out re-raises it with those frames left out, so the
program (and whoever reads its log) sees its own frames and the one wrapper frame that re-raised.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

__all__ = ["without_recorder_frames"]

_RECORD_DIR = str(Path(__file__).resolve().parent) + "/"


def without_recorder_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame outside ``replay/record/``; ``tb`` itself when every frame is
    the recorder's (an exception of the recorder's own, such as a lockstep divergence)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(_RECORD_DIR):
        first = first.tb_next
    return first if first is not None else tb
