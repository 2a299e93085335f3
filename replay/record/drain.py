"""The recording process's side of a drain process (``replay.format.ring_drain``).

Same surface as the writer thread with a ring (``submit``, ``barrier``, ``stop``, ``failed``,
``alive``, ``journal``), but nothing runs in the program's interpreter between steps: a ring job
is already sealed when ``submit`` sees it, so handing it over is nothing at all. ``submit`` only
waits when asked to (the end marker, a flush) and writes the rare job whose bytes are not all in
the ring (a tensor larger than half the ring) itself, once the drain process has reached it.

The drain process shares this rank's journal lock (its file descriptor is inherited), so the
journal reads as live until both are gone, and ``replay record`` seals it only after. It runs in
a session of its own (a Ctrl-C in the terminal is the program's to handle), without ``site`` (so
``replay record``'s bootstrap does not record it), and ends by itself when this process dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from replay.format.journal import JournalWriter
from replay.format.ring_drain import WAKE_SIGNAL
from replay.format.ring_salvage import H_STOP, H_TAIL_POS, H_TAIL_SEQ, H_WAKEABLE
from replay.record.ring import FORKED
from replay.record.writer import Emitter, Job, PinnedPool

__all__ = ["DrainProcess", "DrainFailed"]

# os._exit: the journal's files are closed and nothing is buffered by then; an interpreter's
# teardown took 30-60 ms, which the recorder's close waits for.
# The wake signal is blocked first, before any import starts a thread (numpy's BLAS pool): every
# thread then inherits the block, and the signal, taken only by the drain's sigtimedwait, never
# reaches its default action (the end of the process).
_CHILD = "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.%s}); " \
         "import os, sys, json; a = json.loads(sys.argv[1]); sys.path[:0] = a['path']; " \
         "from replay.format.ring_drain import child_main; rc = child_main(sys.argv[1:]); sys.stderr.flush(); os._exit(rc)" \
         % WAKE_SIGNAL.name
# How often the liveness of the drain process is checked on the step path (submits).
_CHECK_EVERY = 64


class DrainFailed(RuntimeError):
    """The drain process ended before the recording did. Its text is the drain's own error line
    (``OSError: [Errno 28] No space left on device``), as a writer thread's error would read."""


class DrainProcess(Emitter):
    def __init__(self, journal: JournalWriter, ring: Any, *, pool: PinnedPool, on_error: Callable[[BaseException], None],
                 lock_fd: int) -> None:
        super().__init__(journal, pool)
        self.ring = ring
        self._on_error = on_error
        self._failed = False
        self.crashed = False  # it died without its own error line (killed): its ring is salvaged here
        self._submits = 0
        self._last_end = int(ring.head_words[H_TAIL_POS])
        self._lock = threading.Lock()  # in-process writes of jobs outside the ring, one at a time
        arg = {"path": [p for p in sys.path if isinstance(p, str)], "ring": str(ring.path), "journal": str(journal.journal_path),
               "payload": str(journal.payload_path), "parent": os.getpid(), "max_bytes": journal.max_bytes,
               "wakeable": hasattr(signal, "pthread_sigmask")}
        # -E -S: neither the environment's PYTHON* settings nor site (replay record's bootstrap,
        # a sitecustomize) run in the drain; the path it needs is handed over instead.
        self._proc = subprocess.Popen(
            [sys.executable, "-E", "-S", "-c", _CHILD, json.dumps(arg)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(lock_fd,), start_new_session=True, close_fds=True,
        )
        ring.remote_tail = True
        ring.alive_check = self._check
        ring.on_full = self.wake

    # -- the step path ---------------------------------------------------------------------

    def submit(self, job: Job, timeout: float) -> bool:
        if self._failed:
            return False
        self._submits += 1
        if self._submits % _CHECK_EVERY == 0 and not self._healthy():
            return False
        try:
            if job.external or job.ring_end < 0:
                self._write_here(job, timeout)
            else:
                self._last_end = max(self._last_end, job.ring_end)
                if job.ack is not None:
                    self._wait(lambda: self._tail_pos() >= job.ring_end, timeout)
                    self._done(job)
        except BaseException as e:  # noqa: BLE001 - the recorder turns it into "recording stopped"
            self._fail(e)
            return False
        return True

    def _write_here(self, job: Job, timeout: float) -> None:
        """A job the drain process cannot write: once it has written everything before it
        (it waits at this job), write it here and move the tail past it."""
        with self._lock:
            if job.ring_end >= 0:
                self._wait(lambda: int(self.ring.head_words[H_TAIL_SEQ]) >= job.seq, timeout)
            else:
                self._wait(lambda: self._tail_pos() >= self._last_end, timeout)
            self.journal.refresh_sizes()
            self._last.clear()  # offsets kept here may predate the drain process's writes
            self._write(job)
            if job.ring_end >= 0:
                self._last_end = max(self._last_end, job.ring_end)
                self.ring.release(job.ring_end, job.seq + 1)
        self._done(job)

    # -- waits -----------------------------------------------------------------------------

    def wake(self) -> None:
        """Cut the drain process's sleep short: this process waits for it. Only once the drain
        said it takes the signal (before, the signal would end it); ``send_signal`` never signals
        a process already reaped (whose pid another may have now)."""
        words = getattr(self.ring, "head_words", None)
        try:
            if words is not None and not self.ring.forked and int(words[H_WAKEABLE]):
                self._proc.send_signal(WAKE_SIGNAL)
        except (OSError, TypeError, ValueError):
            pass  # gone, or the ring already unmapped: its sleep ends by itself

    def _tail_pos(self) -> int:
        return int(self.ring.head_words[H_TAIL_POS])

    def _wait(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 0.00005
        if not done():
            self.wake()
        while not done():
            try:
                self._check()
            except DrainFailed:
                # The drain may have done what is waited for and ended between the two looks
                # (it ends once it wrote the end marker): only then is its end not a failure.
                if done():
                    return
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"the drain process did not keep up for {timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def _check(self) -> None:
        """Raise when the drain process has ended (the recording then stops), or in a process
        forked from the one that started it (``ShmRing.forked``: the ring, the journal and the
        drain are the parent's)."""
        if self.ring.forked:
            raise DrainFailed(FORKED)
        code = self._proc.poll()
        if code is None:
            return
        self.crashed = code != 3
        raise DrainFailed(self._why(code))

    def _why(self, code: int) -> str:
        line = ""
        try:
            if self._proc.stderr is not None:
                lines = self._proc.stderr.read(65536).decode(errors="replace").strip().splitlines()
                line = lines[-1] if lines else ""
        except (OSError, ValueError):
            pass
        return line or f"the drain process ended with code {code}"

    def _healthy(self) -> bool:
        try:
            self._check()
            return True
        except DrainFailed as e:
            self._fail(e)
            return False

    def _fail(self, e: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self._on_error(e)

    # -- the writer's surface --------------------------------------------------------------

    def barrier(self, timeout: float) -> bool:
        """Wait until every job handed over so far is in the journal; False on timeout."""
        try:
            self._wait(lambda: self._tail_pos() >= self._last_end, timeout)
            return True
        except (TimeoutError, DrainFailed):
            return False

    def stop(self, timeout: float) -> bool:
        """Ask the drain process to end once nothing whole is left; False if it did not in time.
        This process's journal sizes are then those on disk (for an end marker written here)."""
        if self.ring.forked:
            return False  # a forked process: the drain and the journal are its parent's
        try:
            self.ring.head_words[H_STOP] = 1
        except (TypeError, ValueError):
            pass  # the ring is already unmapped: the process is ending anyway
        self.wake()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        try:
            self.journal.refresh_sizes()
        except OSError:
            pass
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        return True

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def failed(self) -> bool:
        return self._failed
