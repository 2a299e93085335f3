"""User-facing errors.

Every error a user can cause (a bad path, a damaged recording, a step out of range) is a
``ReplayError``: the CLI prints its message on one line and exits with its ``exit_code``; the
library raises it and never calls ``sys.exit``. ``assert`` guards only the code's own invariants.
"""

from __future__ import annotations

__all__ = [
    "ReplayError",
    "UsageError",
    "RecordingNotFound",
    "RecordingDamaged",
    "FormatVersionError",
    "OutOfRange",
    "FactoryError",
    "RerunError",
    "UntrustedRecording",
]


class ReplayError(Exception):
    """Base of the errors a user can cause; ``str(e)`` is one line that says what to do."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        # One line only: a multi-line message would look like a traceback in a terminal.
        super().__init__(" ".join(message.split()))


class UsageError(ReplayError):
    """Arguments that cannot work together, or a value outside what is valid."""

    exit_code = 2


class RecordingNotFound(ReplayError):
    """No recording at the given path, or no recording under ``recordings/``."""

    exit_code = 3


class RecordingDamaged(ReplayError):
    """A recording (or one rank file of it) that cannot be read as written."""

    exit_code = 4


class FormatVersionError(RecordingDamaged):
    """A recording written by a newer or unknown format version."""

    exit_code = 5


class OutOfRange(UsageError):
    """A rank, step, part or name that the recording does not have."""


class FactoryError(ReplayError):
    """The factory named by a recording (or ``--factory``) cannot be imported or called."""

    exit_code = 6


class RerunError(ReplayError):
    """A re-run cannot be set up (missing keyframe, collective recorded as digest only, ...)."""

    exit_code = 7


class CatchUpRaised(RerunError):
    """A catch-up step raised in the re-run, not as recorded: the requested step cannot be reached.

    For ``replay step`` that is a failure; for a bisection it is an answer (the re-run departs
    at ``step``), so the step and the keyframe it was caught up from travel with the message."""

    def __init__(self, message: str, *, step: int, keyframe: int) -> None:
        super().__init__(message)
        self.step = step
        self.keyframe = keyframe


# issue 16: the trust model (replay/trust.py, docs/security.md)
class UntrustedRecording(ReplayError):
    """A re-run would import code that a recording names, and nothing says the user trusts it:
    the recording is not this user's signed, unchanged recording, and the names are neither
    ones the user chose nor under a trusted prefix. ``--trust`` consents."""

    exit_code = 8
