"""Bisection: the first step, the first layer and the smallest setting where a step diverges.

``replay.api`` holds the functions the CLI calls (taking a ``Part``); these are the modules'."""

from replay.bisect.config import ConfigBisection, ConfigBisectSettings, Criterion, bisect_config
from replay.bisect.layers import LayersBisection, Side, bisect_layers, parse_between
from replay.bisect.steps import StepsBisection, bisect_steps, bisect_steps_rerun
from replay.bisect.taps import TapCapture, Taps

__all__ = [
    "ConfigBisectSettings",
    "ConfigBisection",
    "Criterion",
    "LayersBisection",
    "Side",
    "StepsBisection",
    "TapCapture",
    "Taps",
    "bisect_config",
    "bisect_layers",
    "bisect_steps",
    "bisect_steps_rerun",
    "parse_between",
]
