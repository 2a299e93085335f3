"""replay: record and replay multi-GPU LLM inference, and find where ranks drift."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public surface, imported on first use: the CLI's table-reading commands (`info`, `verify`,
# `report`) then start without importing torch.
_EXPORTS = {
    "FORMAT_VERSION": "replay.format.schema",
    "Recorder": "replay.record.recorder",
    "RecorderConfig": "replay.record.config",
    "Recording": "replay.format.reader",
    "open_recording": "replay.format.reader",
    "ReplayError": "replay.errors",
    "rerun_step": "replay.rerun.runner",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from replay.errors import ReplayError
    from replay.format.reader import Recording, open_recording
    from replay.format.schema import FORMAT_VERSION
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder
    from replay.rerun.runner import rerun_step


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
