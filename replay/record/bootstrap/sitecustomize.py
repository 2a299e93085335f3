"""Injected by ``replay record`` into every Python process of the recorded command.

It must never break the program: any failure here prints one line and the program runs
unrecorded. Afterwards it hands over to the ``sitecustomize`` the environment had before
(``replay.sitechain``, shared with the re-run's bootstrap).
"""

import os
import sys

try:
    from replay.record.auto import start as _replay_start

    _replay_start()
except Exception as _e:  # noqa: BLE001
    sys.stderr.write(f"replay: recording disabled in process {os.getpid()}: {_e.__class__.__name__}: {_e}\n")

try:
    from replay.sitechain import run_next as _run_next
except Exception as _e:  # noqa: BLE001 - only if the package itself cannot be imported
    sys.stderr.write(f"replay: the environment's own sitecustomize was not run: {_e.__class__.__name__}: {_e}\n")
else:
    _run_next(os.path.dirname(os.path.abspath(__file__)))
