"""Injected by ``replay record`` into every Python process of the recorded command.

It must never break the program: any failure here prints one line and the program runs
unrecorded. Afterwards it hands over to the ``sitecustomize`` the environment had before.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    from replay.record.auto import start as _replay_start

    _replay_start()
except Exception as _e:  # noqa: BLE001
    sys.stderr.write(f"replay: recording disabled in process {os.getpid()}: {_e.__class__.__name__}: {_e}\n")

# Chain to the next sitecustomize on the path, if there is one.
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
    # The import that is running this file expects to find this module under its name.
    if _ours is not None:
        sys.modules["sitecustomize"] = _ours
