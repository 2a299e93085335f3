"""Loaded by every Python process started with this folder first on PYTHONPATH: switches the
record ring's commit to the driver's stream write (``Staging.DRIVER_COMMIT``), so that a
`replay record` of a multi-process program runs with it in every rank (a diagnostic only)."""

import os

if os.environ.get("REPLAY_DIAG_DRIVER_COMMIT") == "1":
    from replay.record.staging import Staging

    Staging.DRIVER_COMMIT = True
