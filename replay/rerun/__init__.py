"""Re-running recorded steps: rebuild the target, restore state, replay inputs and collectives."""

from replay.rerun.runner import MODES, ModeRun, StepRerun, rerun_step
from replay.rerun.target import Target, TargetSpec, build_target

__all__ = ["MODES", "ModeRun", "StepRerun", "Target", "TargetSpec", "build_target", "rerun_step"]
