"""Recording: the in-process ``Recorder`` and the automatic instrumentation of ``replay record``."""

from replay.record.config import RecorderConfig
from replay.record.recorder import Recorder

__all__ = ["Recorder", "RecorderConfig"]
