"""Injected by ``replay step`` into a re-launched recorded program (replay mode, no recording).

``replay.rerun.relaunch.start_in_program`` arms the take-over of the step's first call. A failure
here is one line and the program runs on unchanged: the parent then says the step was never
reached. Afterwards it hands over to the ``sitecustomize`` the environment had before.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    from replay.rerun.relaunch import start_in_program as _replay_start

    _replay_start()
except Exception as _e:  # noqa: BLE001
    sys.stderr.write(f"replay: re-run mode could not start in process {os.getpid()}: {_e.__class__.__name__}: {_e}\n")

_saved_path = list(sys.path)
_ours = sys.modules.pop("sitecustomize", None)
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    import sitecustomize  # noqa: F401
except ImportError:
    pass
except Exception as _e:  # noqa: BLE001
    sys.stderr.write(f"replay: the environment's own sitecustomize failed: {_e}\n")
finally:
    sys.path[:] = _saved_path
    if _ours is not None:
        sys.modules["sitecustomize"] = _ours
