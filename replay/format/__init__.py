"""The recording format (version 1): the only package that touches h5py.

See ``docs/format.md`` for the layout and why it is crash-safe.

The names below are imported on first use: the drain process (``ring_drain``, numpy only) then
starts without the reader and h5py, in about half the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("FrameKind", "JournalWriter", "read_journal"), "replay.format.journal"),
    **dict.fromkeys(("Part", "RankFile", "Recording", "StepView", "find_recordings", "open_recording", "resolve_recording"),
                    "replay.format.reader"),
    **dict.fromkeys(("FORMAT_VERSION", "RunMode", "StepStatus", "TensorKind", "TensorRef", "rank_stem"), "replay.format.schema"),
    **dict.fromkeys(("SealResult", "journal_is_live", "seal_part", "seal_rank"), "replay.format.seal"),
    "RankTables": "replay.format.tables",
}

if TYPE_CHECKING:
    from replay.format.journal import FrameKind, JournalWriter, read_journal
    from replay.format.reader import Part, RankFile, Recording, StepView, find_recordings, open_recording, resolve_recording
    from replay.format.schema import FORMAT_VERSION, RunMode, StepStatus, TensorKind, TensorRef, rank_stem
    from replay.format.seal import SealResult, journal_is_live, seal_part, seal_rank
    from replay.format.tables import RankTables


__getattr__ = lazy_exports("replay.format", _EXPORTS, globals())


__all__ = [
    "FORMAT_VERSION",
    "FrameKind",
    "JournalWriter",
    "Part",
    "RankFile",
    "RankTables",
    "Recording",
    "RunMode",
    "SealResult",
    "StepStatus",
    "StepView",
    "TensorKind",
    "TensorRef",
    "find_recordings",
    "journal_is_live",
    "open_recording",
    "rank_stem",
    "read_journal",
    "resolve_recording",
    "seal_part",
    "seal_rank",
]
