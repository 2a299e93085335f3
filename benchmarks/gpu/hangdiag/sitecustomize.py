"""Diagnostics only: with HANGDIAG_AFTER=SECONDS, every Python process that is still alive after
that long writes the stacks of all its threads to HANGDIAG_DIR/stacks-PID.txt."""
import faulthandler
import os

_after = float(os.environ.get("HANGDIAG_AFTER", "0") or 0)
if _after > 0:
    _fh = open(os.path.join(os.environ.get("HANGDIAG_DIR", "/tmp"), f"stacks-{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(_after, repeat=False, file=_fh, exit=False)
