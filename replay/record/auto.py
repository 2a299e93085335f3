"""Start recording in this process if ``replay record`` asked for it (see ``bootstrap``)."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Any

from replay.record.session import Session
from replay.record.settings import current

__all__ = ["start", "session"]

_session: Session | None = None
# How long a SIGTERM waits for the recorder to write its end marker and seal before dying.
_SIGTERM_SHUTDOWN_S = 10.0


def session() -> Session | None:
    return _session


def start() -> Session | None:
    """Install the recording session described by the environment; idempotent."""
    global _session
    if _session is not None:
        return _session
    found = current()
    if found is None:
        return None
    out, settings = found
    _session = Session(out, settings)
    _session.install()
    atexit.register(_session.shutdown)
    _close_on_sigterm(_session)
    return _session


def _close_on_sigterm(s: Session) -> None:
    """On SIGTERM, write what is buffered (the logits ring), then die by the signal as before."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the program handles SIGTERM itself; its handler decides

    closing: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        if closing:
            # A second SIGTERM (a launcher that terms its ranks after the wrapper already did)
            # lands inside the first one's shutdown: let that finish; it then dies by the signal.
            return
        closing.append(True)
        # On the main thread, which the signal interrupted: the locks it may hold (the
        # recorder's and the session's, say in a step's wait for its write) are re-entrant, so
        # shutting down here cannot wait on them, where a thread of its own would wait for the
        # main thread forever. A plain lock held at the moment of the signal (a queue's, for an
        # instant) could still block it: the watchdog bounds that, since dying late is better
        # than not dying. Steps already written are kept either way.
        watchdog = threading.Timer(_SIGTERM_SHUTDOWN_S, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()
        try:
            s.shutdown()
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        pass
