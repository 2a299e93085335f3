"""Start recording in this process if ``replay record`` asked for it (see ``bootstrap``)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Any

from replay.record.session import Session
from replay.record.settings import current

__all__ = ["start", "session"]

_session: Session | None = None
# How long a SIGTERM waits for the recorder to write its end marker and seal before dying.
_SIGTERM_SHUTDOWN_S = 10.0
# The SIGTERM handler ``_close_on_sigterm`` installed in this process (None: none installed).
_sigterm_handler: Any = None


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
    atexit.register(_shutdown_at_exit, _session)
    _close_on_sigterm(_session)
    _note_uncaught(_session)
    return _session


def _note_uncaught(s: Session) -> None:
    """Keep the error a program ends on (uncaught in its main thread), for the rank's end marker:
    the rank that failed is then named by ``info``, not only a peer's error about it (a closed
    connection in its next collective). The program's own hook, or Python's, runs as before."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            s.uncaught = f"{kind.__name__}: {value}"[:500]
        except Exception:  # noqa: BLE001 - an exception whose str raises: the kind alone
            s.uncaught = getattr(kind, "__name__", "an exception")
        rec = s.recorder
        if rec is not None:
            rec.uncaught = s.uncaught  # its own atexit close runs before the session's
        previous(kind, value, tb)

    sys.excepthook = excepthook


def _shutdown_at_exit(s: Session) -> None:
    """The last ``atexit`` call (registered first): close the recording, and keep the exit
    status the program would have had without it."""
    interrupted = _ended_by_keyboard_interrupt()
    try:
        s.shutdown()
    finally:
        if interrupted:
            _keep_sigint_exit()


def _ended_by_keyboard_interrupt() -> bool:
    """Whether the program is ending on an uncaught KeyboardInterrupt out of its main module.

    Python then dies by SIGINT after finalizing (exit status 130), deciding so by a flag set
    when the main module's code raised it. Running any ``exec``/``eval`` of a string clears
    that flag (CPython's ``run_eval_code_obj``), and closing the recording may (a
    ``namedtuple`` or a ``dataclass`` made by a module first imported here), so the process
    would exit 1 instead. The interpreter printed the exception with ``PyErr_Print``, which
    left it in ``sys.last_value``; its traceback starts in the outermost frame (the main
    module's, or runpy's for ``-m``) only when it came out of the main module's code."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, KeyboardInterrupt):
        return False
    tb = exc.__traceback__
    return tb is not None and tb.tb_frame.f_back is None


def _keep_sigint_exit() -> None:
    """Set the interpreter's "unhandled KeyboardInterrupt" flag again, so Python ends by SIGINT
    as it would have without the recorder. Running a string that raises KeyboardInterrupt sets
    it, by the same code path as the main module's (``run_eval_code_obj``); the string is a
    constant (nothing of a recording is ever run), given to ``PyRun_StringFlags`` directly."""
    import ctypes

    try:
        run = ctypes.pythonapi.PyRun_StringFlags
        run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.c_void_p]
        run.restype = ctypes.py_object
        run(b"raise KeyboardInterrupt", 257, {}, {}, None)  # 257: Py_file_input
    except KeyboardInterrupt:
        pass
    except Exception:  # noqa: BLE001 - never fail the program's exit over its status
        pass


def _close_on_sigterm(s: Session) -> None:
    """On SIGTERM, write what is buffered (the logits ring), then die by the signal as before."""
    global _sigterm_handler
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
        _start_watchdog(signum)
        defer = getattr(s, "defer_until_closed", None)
        if defer is not None and defer(lambda: _shutdown_and_die(s, signum)):
            return  # the signal landed inside the recorder's own close: it ends once that is done
        _shutdown_and_die(s, signum)

    handler.closing = closing  # type: ignore[attr-defined]
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return
    _sigterm_handler = handler
    os.register_at_fork(after_in_child=_watch_sigterm_in_child)


def _shutdown_and_die(s: Session, signum: int) -> None:
    try:
        s.shutdown()
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _start_watchdog(signum: int) -> None:
    watchdog = threading.Timer(_SIGTERM_SHUTDOWN_S, os._exit, args=(128 + signum,))
    watchdog.daemon = True
    watchdog.start()


# -- a forked process: SIGTERM must still end it when its main thread is blocked in C ---------
#
# The handler is Python code: it runs only when the main thread next runs bytecode. A process
# forked from the recorded one inherits it (a rank forked by its launcher seals its recording
# with it), and one blocked in C may never get there: a ``multiprocessing.Pool`` worker waiting
# for the task queue's lock when ``Pool.terminate`` terms it, the signal taken by another of its
# threads (an OpenMP worker) or arriving just before the wait began. Without the recorder the
# default action would have ended it at once; it hung. So a forked process has a thread that
# Python's C-level signal handler wakes (``signal.set_wakeup_fd``, written from whatever thread
# took the signal): on SIGTERM it sends the signal to the main thread again (a wait that a
# signal interrupts returns, and the handler runs there), and if the handler has still not
# started after ``_SIGTERM_MAIN_GRACE_S``, closes the recording itself and ends the process,
# within the same watchdog. Only while the handler is still the recorder's and the wakeup fd
# still its own (a program that sets its own, as asyncio does, gets the old behaviour).

_SIGTERM_MAIN_GRACE_S = 1.0
_wakeup_fds: tuple[int, int] | None = None  # (read, write) of this process's watcher pipe


def _watch_sigterm_in_child() -> None:
    global _wakeup_fds
    try:
        inherited, _wakeup_fds = _wakeup_fds, None
        if inherited is not None:
            # The parent's pipe: the parent's watcher must not take this process's signals.
            current = signal.set_wakeup_fd(-1)
            if current != inherited[1]:
                signal.set_wakeup_fd(current)  # the program's own: leave it
            for fd in inherited:
                os.close(fd)
            if current != inherited[1]:
                return
        if _sigterm_handler is None or signal.getsignal(signal.SIGTERM) is not _sigterm_handler:
            return
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(r, True)
        try:
            if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:
                raise ValueError("the program has its own wakeup fd")
        except (ValueError, OSError):
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
            return
        _wakeup_fds = (r, w)
        threading.Thread(target=_sigterm_watcher, args=(r,), name="replay-sigterm", daemon=True).start()
    except Exception:  # noqa: BLE001 - the program's fork goes on, with the handler alone
        pass


def _sigterm_watcher(r: int) -> None:
    while True:
        try:
            got = os.read(r, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not got:
            return
        if signal.SIGTERM in got:
            _make_sigterm_end(signal.SIGTERM)
            return


def _make_sigterm_end(signum: int) -> None:
    """Called off the main thread once SIGTERM has arrived: see that it ends the process."""
    handler = _sigterm_handler
    if handler is None or signal.getsignal(signum) is not handler:
        return  # the program's handler now, or the default action already restored
    closing: list[bool] = handler.closing
    main = threading.main_thread().ident
    deadline = time.monotonic() + _SIGTERM_MAIN_GRACE_S
    while not closing and time.monotonic() < deadline:
        try:
            signal.pthread_kill(main, signum)  # interrupts a wait of the main thread
        except (OSError, ValueError):
            break
        time.sleep(0.1)
    if closing:
        return  # the handler runs on the main thread, with its watchdog
    # The main thread is stuck in C: close the recording from here (it may wait on a lock the
    # main thread holds; the watchdog bounds that) and end as the signal would have.
    closing.append(True)
    _start_watchdog(signum)
    try:
        if _session is not None:
            _session.shutdown()
    except Exception:  # noqa: BLE001
        pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(128 + signum)
