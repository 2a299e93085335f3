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

    def handler(signum: int, frame: Any) -> None:
        try:
            # On a thread, with a bound: the signal may have interrupted the main thread while it
            # held a lock that shutting down needs (the writer queue's), and dying late is
            # better than not dying. Steps already written are kept either way.
            t = threading.Thread(target=s.shutdown, name="replay-sigterm", daemon=True)
            t.start()
            t.join(_SIGTERM_SHUTDOWN_S)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        pass
