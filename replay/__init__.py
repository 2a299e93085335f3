"""replay: record and replay multi-GPU LLM inference, and find where ranks drift.

The public surface: open a recording, then ask it questions (``replay.api``; see
docs/python-api.md)::

    import replay

    with replay.open_recording("recordings/20261130-120000-test_mtp") as rec:
        print(replay.info(rec).first_divergence)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay._lazy import lazy_exports
from replay._version import __version__

# The public surface, imported on first use: the CLI's table-reading commands (`info`, `verify`,
# `report`) then start without importing torch.
_API = "replay.api"
_EXPORTS = {
    "FORMAT_VERSION": "replay.format.schema",
    "Recorder": "replay.record.recorder",
    "RecorderConfig": "replay.record.config",
    "RecordConfig": "replay.record.config",
    "Recording": "replay.format.reader",
    "Part": "replay.format.reader",
    "open_recording": "replay.format.reader",
    "ReplayError": "replay.errors",
    "Divergence": "replay.analysis.divergence",
    "first_divergence": "replay.analysis.divergence",
    "rerun_step": "replay.rerun.runner",
    "ConfigBisectSettings": "replay.bisect.config",
    **{name: _API for name in (
        "InfoResult", "PartInfo", "RecordOutcome", "ReportResult", "RerunOptions", "SealOutcome", "VerifyResult",
        "bisect_config", "bisect_layers", "bisect_runs", "bisect_steps", "bisect_steps_rerun", "choose_part", "default_device",
        "detect_node_rank", "info", "make_recording_dir", "make_report", "record_run", "seal", "step", "step_ranks", "verify",
    )},
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from replay.analysis.divergence import Divergence, first_divergence
    from replay.api import (
        InfoResult,
        PartInfo,
        RecordOutcome,
        ReportResult,
        RerunOptions,
        SealOutcome,
        VerifyResult,
        bisect_config,
        bisect_layers,
        bisect_runs,
        bisect_steps,
        bisect_steps_rerun,
        choose_part,
        default_device,
        detect_node_rank,
        info,
        make_recording_dir,
        make_report,
        record_run,
        seal,
        step,
        step_ranks,
        verify,
    )
    from replay.bisect.config import ConfigBisectSettings
    from replay.errors import ReplayError
    from replay.format.reader import Part, Recording, open_recording
    from replay.format.schema import FORMAT_VERSION
    from replay.record.config import RecordConfig, RecorderConfig
    from replay.record.recorder import Recorder
    from replay.rerun.runner import rerun_step


__getattr__ = lazy_exports("replay", _EXPORTS, globals())
