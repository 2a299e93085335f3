"""Injected by ``replay step`` into a re-launched recorded program (replay mode, no recording).

``replay.rerun.relaunch.start_in_program`` points the program's file writes at a scratch directory
(its start-up runs again: ``replay.rerun.sandbox``) and arms the take-over of the step's first call. A failure
here is one line and the program runs on unchanged: the parent then says the step was never
reached. Afterwards it hands over to the ``sitecustomize`` the environment had before
(``replay.sitechain``, shared with the recorder's bootstrap).
"""

import os
import sys

try:
    from replay.rerun.relaunch import start_in_program as _replay_start

    _replay_start()
except Exception as _e:  # noqa: BLE001
    sys.stderr.write(f"replay: re-run mode could not start in process {os.getpid()}: {_e.__class__.__name__}: {_e}\n")

try:
    from replay.sitechain import run_next as _run_next
except Exception as _e:  # noqa: BLE001 - only if the package itself cannot be imported
    sys.stderr.write(f"replay: the environment's own sitecustomize was not run: {_e.__class__.__name__}: {_e}\n")
else:
    _run_next(os.path.dirname(os.path.abspath(__file__)))
