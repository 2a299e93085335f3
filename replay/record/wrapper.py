"""``replay record -- CMD``: run CMD with the recorder injected, then seal what its ranks left.

CMD runs in its own process group, which becomes the terminal's foreground group when there is
a terminal, so Ctrl-C reaches CMD and its ranks exactly as it would without ``replay``; the signals
the wrapper itself receives (SIGTERM from a scheduler, say) are forwarded to that group. When CMD
ends, however it ends, the wrapper waits for rank processes still writing, seals every journal,
writes the manifest, and returns CMD's exit status (128 + N when a signal N ended it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import replay
from replay.errors import UsageError
from replay.format import perms as _perms  # issue 16
from replay.format.manifest import write_manifest
from replay.format.seal import SealResult, journal_is_live, seal_part
from replay.log import get_logger
from replay.record.settings import ENV_DIR, ENV_SETTINGS, RecordSettings

__all__ = ["RecordResult", "record_command", "recording_dir_for", "child_environment"]

log = get_logger("replay.record")

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(slots=True)
class RecordResult:
    path: Path
    exit_code: int
    sealed: list[tuple[str, SealResult]] = field(default_factory=list)
    still_live: list[str] = field(default_factory=list)
    signal: int | None = None


def _slug(cmd: list[str]) -> str:
    words = []
    for a in cmd[:6]:
        if a.startswith("-") and a not in ("-m",):
            continue
        base = Path(a).name
        base = re.sub(r"\.py$", "", base)
        if base in ("-m", "python", "python3", "env") or not base:
            continue
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
        "replay_version": replay.__version__,
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
    try:
        try:
            proc = subprocess.Popen(cmd, env=env, process_group=0)
        except OSError as e:
            manifest.update(status="failed to start", error=str(e), ended_at=time.time())
            _try_write_manifest(out, manifest, node)
            raise
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
