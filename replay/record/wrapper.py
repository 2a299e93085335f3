"""``replay record -- CMD``: run CMD with the recorder injected, then seal what its ranks left.

CMD runs in its own process group, which becomes the terminal's foreground group when there is
a terminal, so Ctrl-C reaches CMD and its ranks exactly as it would without ``replay``; the signals
the wrapper itself receives (SIGTERM from a scheduler, say) are forwarded to that group. When CMD
ends, however it ends, the wrapper waits for rank processes still writing, seals every journal,
writes the manifest, and returns CMD's exit status (128 + N when a signal N ended it).

When the wrapper's stdin is not a terminal (a pipe, a file), a copy of what CMD is given on it is
kept in the recording (``stdin.bin``), so that ``replay step`` can give a re-launched program its
input again; a terminal is CMD's own, as without ``replay``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import replay
from replay._version import __version__  # arch (#18): the version from one place, not the package root
from replay.errors import UsageError
from replay.format import perms as _perms  # issue 16
from replay.format.manifest import STDIN_COPY, stdin_id, write_manifest
from replay.format.seal import SealResult, journal_is_live, seal_part
from replay.log import get_logger
from replay.record.settings import ENV_DIR, ENV_SETTINGS, RecordSettings

__all__ = ["RecordResult", "record_command", "recording_dir_for", "child_environment"]

log = get_logger("replay.record")

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STDIN_COPY_LIMIT = 64 << 20  # a larger stdin is passed on, not kept


@dataclass(slots=True)
class RecordResult:
    path: Path
    exit_code: int
    sealed: list[tuple[str, SealResult]] = field(default_factory=list)
    still_live: list[str] = field(default_factory=list)
    signal: int | None = None


def _slug(cmd: list[str]) -> str:
    """A recording's name from its command: the launcher and the script or module it runs
    (``torchrun-train``, ``mypkg.serve``), never an option's value (``python3 -W error x.py`` is
    ``x``, not ``error-x``)."""
    words: list[str] = []
    skip = module = False
    for a in cmd[:16]:
        if skip or a.startswith("-"):
            skip, module = a in ("-W", "-X"), a == "-m"
            continue
        if module:
            words.append(a)  # python -m pkg.mod: the module is the program
            break
        base = Path(a).name
        if base.endswith(".py"):
            words.append(base[:-3])  # the script: what follows is its arguments
            break
        if re.fullmatch(r"python[0-9.]*|env|[0-9.]+|\w+=.*", base) or not base:
            continue  # an interpreter, a number (an option's value), VAR=value
        words.append(base)
        if len(words) == 2:
            break
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(words)).strip("-.")
    return (slug or "run")[:48]


def recording_dir_for(cmd: list[str], root: Path, name: str | None = None) -> Path:
    """A new ``<root>/<YYYYmmdd-HHMMSS>-<name>`` directory (created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{name or _slug(cmd)}"
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        p = root / (base if i == 1 else f"{base}-{i}")
        try:
            _perms.mkdir(p)  # issue 16: owner-only unless widened, whatever the umask
            return p
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a recording directory under {root}")


def child_environment(out: Path, settings: RecordSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process of CMD record into ``out``."""
    env = dict(os.environ if base is None else base)
    bootstrap = Path(replay.__file__).resolve().parent / "record" / "bootstrap"
    package_root = Path(replay.__file__).resolve().parent.parent
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap), str(package_root)] + ([old] if old else []))
    env[ENV_DIR] = str(out.resolve())
    env[ENV_SETTINGS] = settings.to_env()
    return env


def _any_live(out: Path) -> list[Path]:
    return [j for j in out.glob("*/rank-*.journal") if journal_is_live(j)]


def record_command(
    cmd: list[str],
    settings: RecordSettings,
    *,
    out: Path,
    node: int | None = None,
    grace_s: float = 30.0,
) -> RecordResult:
    """Run ``cmd`` recording into ``out``; return once it has ended and its files are sealed.

    Before CMD starts, a recording directory that cannot be written is a ``UsageError`` (nothing
    has run yet). Once CMD has started, nothing the recording does can change the result: a
    journal that cannot be sealed stays a readable journal, a manifest that cannot be written is
    a warning, and the exit code is always CMD's.
    """
    env = child_environment(out, settings)
    started = time.time()
    manifest: dict[str, Any] = {
        "command": cmd,
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "node": node,
        "started_at": started,
        "status": "recording",
        "settings": _settings_json(settings),
        "replay_version": __version__,
    }
    try:
        _sign_manifest(write_manifest(out, manifest, node=node))  # issue 16: this user started it
    except OSError as e:
        raise UsageError(
            f"cannot write the recording to {out} ({e.strerror or e}): choose a writable directory with --out"
        ) from None
    # Installed before CMD starts, so that a signal sent to us in between is not lost: it is
    # delivered to CMD's group as soon as there is one.
    child: list[int] = []
    pending: list[int] = []
    previous = {}

    def forward(signum: int, _frame: Any) -> None:
        if not child:
            pending.append(signum)
            return
        try:
            os.killpg(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                # Ignored here (a background job, nohup): leave it so, and CMD inherits that, as
                # it would without us. A handler of ours would be reset to the default by exec,
                # making CMD interruptible where it was not.
                continue
            previous[sig] = signal.signal(sig, forward)
        except (ValueError, OSError):
            pass
    tty = None
    stdin = _stdin_copy(out, node)
    try:
        try:
            proc = subprocess.Popen(cmd, env=env, process_group=0, stdin=stdin.child_stdin if stdin is not None else None)
        except OSError as e:
            manifest.update(status="failed to start", error=str(e), ended_at=time.time())
            _try_write_manifest(out, manifest, node)
            raise
        # What CMD was given on stdin, as its processes see it (replay.record.launch.stdin_id).
        manifest["stdin_id"] = stdin_id(proc.stdin.fileno() if proc.stdin is not None else 0)
        if stdin is not None:
            stdin.feed(proc)
        child.append(proc.pid)
        tty = _take_terminal(proc.pid)
        for signum in pending:
            forward(signum, None)
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded, not raised
                continue
    finally:
        _give_back_terminal(tty)
        for sig, h in previous.items():
            signal.signal(sig, h)
        if stdin is not None:
            stdin.finish()
    result = RecordResult(path=out, exit_code=rc if rc >= 0 else 128 - rc, signal=-rc if rc < 0 else None)
    try:
        _finish(out, result, grace_s, sign_after=started)  # issue 16: sign what this command recorded
    except OSError as e:
        _warn(f"could not finish the recording in {out} ({e}); its journals are kept and readable")
    manifest.update(
        status="complete" if not result.still_live else "ranks still running",
        exit_code=result.exit_code,
        signal=result.signal,
        ended_at=time.time(),
        parts=_parts(out),
        still_live=result.still_live,
    )
    _try_write_manifest(out, manifest, node)
    return result


def _finish(out: Path, result: RecordResult, grace_s: float, sign_after: float | None = None) -> None:
    """Wait for ranks that outlive CMD, seal what they left, tidy empty parts."""
    # Rank processes can outlive CMD (a launcher killed first): give them a moment to finish.
    deadline = time.monotonic() + grace_s
    while _any_live(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    for part in sorted(p for p in out.iterdir() if p.is_dir()):
        for r in seal_part(part, sign_after=sign_after):  # issue 16
            if r.error is not None:
                _warn(f"could not seal {part.name} rank {r.rank} ({r.error}); its journal is kept and readable")
            result.sealed.append((part.name, r))
    result.still_live = [str(j.relative_to(out)) for j in _any_live(out)]
    # Empty part directories (a process group that never got to record) would only confuse.
    for part in out.iterdir():
        try:
            if part.is_dir() and not any(part.iterdir()):
                part.rmdir()
        except OSError:
            pass


def _parts(out: Path) -> list[str]:
    try:
        return sorted(p.name for p in out.iterdir() if p.is_dir())
    except OSError:
        return []


def _sign_manifest(path: Path) -> None:
    # issue 16: a manifest signed by this user says `replay seal` may sign what it seals here
    from replay.trust import sign_manifest

    sign_manifest(path)


def _try_write_manifest(out: Path, manifest: dict[str, Any], node: int | None) -> None:
    try:
        _sign_manifest(write_manifest(out, manifest, node=node))  # issue 16
    except OSError as e:
        _warn(f"could not write the manifest of {out} ({e.strerror or e}); the rank files are kept")


def _warn(message: str) -> None:
    # One line on stderr: the wrapper's result is CMD's exit code, whatever happened here.
    log.warning("%s", message)


def _settings_json(settings: RecordSettings) -> dict[str, Any]:
    import json

    return json.loads(settings.to_env())


class _StdinCopy:
    """A copy of what CMD is given on stdin, kept in the recording for ``replay step`` (which gives
    it to a re-launched program). A terminal stays CMD's own and is not copied; a file (or
    /dev/null) is passed on untouched, as CMD may seek it, and its bytes are copied before CMD
    starts; a pipe is fed to CMD through a pipe of ours, copied as it streams (read ahead of CMD by
    at most a pipe's buffer). Past ``STDIN_COPY_LIMIT`` (or on a write error) the copy is dropped,
    with one line at the end; CMD gets its whole stdin whatever happens to the copy."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.size = 0
        self.dropped: str | None = None
        self.pipe = False
        self.thread: threading.Thread | None = None
        kind = _stdin_kind()
        if kind in (None, "tty"):
            return
        try:
            self.fd = _perms.open_new(path, os.O_WRONLY | os.O_EXCL)  # the recording's mode; never another's copy
        except OSError:
            return  # (a recording added to, which holds one already): stdin is passed on, not copied
        if kind == "file":
            self._copy_file()
        self.pipe = kind == "stream"

    @property
    def child_stdin(self) -> int | None:
        return subprocess.PIPE if self.pipe else None

    def feed(self, proc: subprocess.Popen) -> None:
        if not self.pipe or proc.stdin is None:
            return
        try:
            self.thread = threading.Thread(target=self._pump, args=(proc.stdin,), name="replay-stdin", daemon=True)
            self.thread.start()
        except Exception as e:  # noqa: BLE001 - CMD then reads an empty stdin rather than wait forever
            self.thread = None
            proc.stdin.close()
            self._drop(f"it could not be fed to CMD: {e}")

    def finish(self) -> None:
        """After CMD: the copy is whole unless a writer upstream still holds the pipe open (the
        daemon thread then feeds whatever is left of CMD's processes until the wrapper exits)."""
        if self.thread is not None:
            self.thread.join(timeout=0.1)  # only what it took last: a pipe still open upstream never ends it
        else:
            self._close_copy()
        if self.dropped:
            _warn(f"no copy of CMD's stdin was kept ({self.dropped}): `replay step` gives a re-launched program "
                  "an empty stdin")

    def _copy_file(self) -> None:
        try:
            offset = os.lseek(0, 0, os.SEEK_CUR)  # where CMD will start reading
            while self.fd is not None and (chunk := os.pread(0, 1 << 20, offset)):
                self._keep(chunk)
                offset += len(chunk)
        except OSError as e:
            self._drop(f"stdin could not be read: {e.strerror or e}")

    def _pump(self, to_cmd: Any) -> None:
        try:
            while chunk := os.read(0, 1 << 16):
                _write_all(to_cmd.fileno(), chunk)  # CMD gets it first; a closed pipe (EPIPE) ends it
                self._keep(chunk)
        except OSError:
            pass
        finally:
            try:
                to_cmd.close()  # CMD sees the end of its stdin
            except OSError:
                pass
            self._close_copy()

    def _keep(self, chunk: bytes) -> None:
        if self.fd is None:
            return
        if self.size + len(chunk) > STDIN_COPY_LIMIT:
            self._drop(f"it is over {STDIN_COPY_LIMIT >> 20} MiB")
            return
        try:
            _write_all(self.fd, chunk)
            self.size += len(chunk)
        except OSError as e:
            self._drop(f"it could not be written: {e.strerror or e}")

    def _drop(self, reason: str) -> None:
        self.dropped = self.dropped or reason
        self._close_copy()
        try:
            self.path.unlink()
        except OSError:
            pass

    def _close_copy(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _stdin_copy(out: Path, node: int | None) -> _StdinCopy | None:
    """The copy of CMD's stdin, or None (another node's stdin is its own; nothing here may keep
    CMD from running as it would)."""
    if node:
        return None
    try:
        return _StdinCopy(out / STDIN_COPY)
    except Exception as e:  # noqa: BLE001
        _warn(f"no copy of CMD's stdin was kept ({e}); it is passed on as it is")
        return None


def _stdin_kind() -> str | None:
    """``tty``, ``file`` (a regular file or /dev/null), ``stream`` (a pipe, a socket), or None (no stdin)."""
    try:
        st = os.fstat(0)
        if os.isatty(0):
            return "tty"
        if stat.S_ISREG(st.st_mode) or os.path.samestat(st, os.stat(os.devnull)):
            return "file"
    except OSError:
        return None
    return "stream"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _take_terminal(pgid: int) -> tuple[int, int] | None:
    """Make CMD's group the terminal's foreground group, as a shell would; (fd, our group)."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(fd, pgid)
        finally:
            signal.signal(signal.SIGTTOU, old)
        return fd, os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return None


def _give_back_terminal(tty: tuple[int, int] | None) -> None:
    if tty is None:
        return
    fd, pgid = tty
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)
