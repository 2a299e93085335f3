"""Hand over to the environment's own ``sitecustomize`` (what the two bootstraps share).

``replay record`` and ``replay step`` put a directory holding their own ``sitecustomize.py`` first
on the ``PYTHONPATH`` of the programs they start (``record/bootstrap/``, ``rerun/bootstrap/``).
That hides any ``sitecustomize`` the environment already had (a virtualenv's, a cluster's); each
bootstrap ends by calling ``run_next`` so that one still runs. This module runs at interpreter
start-up, inside ``site``: it imports only the standard library, and never raises.
"""

from __future__ import annotations

import os
import sys

__all__ = ["run_next"]


def run_next(bootstrap_dir: str) -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` after the one in ``bootstrap_dir``, if
    there is one; a failure in it is one line on stderr. ``sys.path`` and
    ``sys.modules["sitecustomize"]`` are left as they were: the import that is running the
    bootstrap expects to find the bootstrap under that name."""
    here = os.path.abspath(bootstrap_dir)
    saved_path = list(sys.path)
    ours = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - the program must start whatever the environment's hook does
        sys.stderr.write(f"replay: the environment's own sitecustomize failed: {e}\n")
    finally:
        sys.path[:] = saved_path
        if ours is not None:
            sys.modules["sitecustomize"] = ours
