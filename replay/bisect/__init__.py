"""Bisection: the first step, the first layer and the smallest setting where a step diverges.

Names are imported on first use, so the light modules (``config_model``, ``state``, ``ddmin``)
import without torch; ``replay.api`` holds the functions the CLI calls."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ConfigBisectSettings": "replay.bisect.config_model",
    "ConfigBisection": "replay.bisect.config_model",
    "Criterion": "replay.bisect.config_model",
    "bisect_config": "replay.bisect.config",
    "LayersBisection": "replay.bisect.layers",
    "Side": "replay.bisect.layers",
    "bisect_layers": "replay.bisect.layers",
    "parse_between": "replay.bisect.layers",
    "StepsBisection": "replay.bisect.steps",
    "bisect_steps": "replay.bisect.steps",
    "bisect_steps_rerun": "replay.bisect.steps",
    "TapCapture": "replay.bisect.taps",
    "Taps": "replay.bisect.taps",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from replay.bisect.config import bisect_config
    from replay.bisect.config_model import ConfigBisection, ConfigBisectSettings, Criterion
    from replay.bisect.layers import LayersBisection, Side, bisect_layers, parse_between
    from replay.bisect.steps import StepsBisection, bisect_steps, bisect_steps_rerun
    from replay.bisect.taps import TapCapture, Taps


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replay.bisect' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
