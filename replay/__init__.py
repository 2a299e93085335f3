"""replay: record and replay multi-GPU LLM inference, and find where ranks drift."""

__version__ = "0.1.0"

from replay.digest import digest, format_digest
from replay.errors import ReplayError
from replay.format import FORMAT_VERSION, Recording, open_recording
from replay.record import Recorder, RecorderConfig

__all__ = [
    "FORMAT_VERSION",
    "Recorder",
    "RecorderConfig",
    "Recording",
    "ReplayError",
    "__version__",
    "digest",
    "format_digest",
    "open_recording",
]
