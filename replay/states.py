"""The states a verdict can be in, one enum per question, shared by the library, the CLI and the
saved results.

They are ``StrEnum``: a state compares equal to its string and serialises as it, so saved results
and ``--json`` output keep their values (``"done"``, ``"matches"``), while code names them."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["BisectStatus", "CheckState", "ProbeOutcome", "ResultKind", "StepsHow", "RESULTS_FORMAT_VERSION"]

RESULTS_FORMAT_VERSION = 1
"""Version of the JSON that ``replay step`` and ``replay bisect`` save in ``<recording>/results/``.

Bumped when a field changes meaning; readers (``replay report``) show results of a newer version
as such instead of misreading them."""


class CheckState(StrEnum):
    """What ``replay verify`` found in a rank file, or a whole recording."""

    INTACT = "intact"
    INCOMPLETE = "incomplete"  # what is there is whole; the end of the run is missing
    DAMAGED = "damaged"  # something recorded cannot be trusted


class BisectStatus(StrEnum):
    """How a configuration bisection ended."""

    DONE = "done"  # a minimal set of toggles was found
    INCOMPLETE = "incomplete"  # the probe budget ran out; run again to resume
    NO_DIVERGENCE = "no-divergence"  # the baseline already matches: nothing to bisect
    NO_FIX = "no-fix"  # no combination of the toggles tried makes it match


class ProbeOutcome(StrEnum):
    """What one probe of a configuration bisection said."""

    MATCHES = "matches"
    DIFFERS = "differs"
    ERROR = "error"


class StepsHow(StrEnum):
    """What a step bisection compared."""

    RANKS = "ranks"  # recorded digests across ranks
    RERUN = "rerun"  # the recording against re-runs of one rank


class ResultKind(StrEnum):
    """The ``kind`` of a saved result (``<recording>/results/*.json``): what wrote it."""

    STEP = "step"  # replay step --rank
    STEP_RANKS = "step-ranks"  # replay step --ranks (printed, not saved)
    BISECT_STEPS = "bisect-steps"
    BISECT_LAYERS = "bisect-layers"
    BISECT_CONFIG = "bisect-config"
