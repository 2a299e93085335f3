"""Permissions of what a recording is made of: owner-only unless the user widens them.

A recording holds prompts, model state, the command line (tokens passed as arguments) and the
working directory, so its files are 0600 and its directories 0700 by default. For a team
directory, ``replay record --permissions group`` (or ``permissions = "group"`` under
``[tool.replay]``, or ``$REPLAY_PERMISSIONS``) makes them group-readable (0640 / 0750), and
``world`` gives the old 0644 / 0755.

The mode is set explicitly (``fchmod`` / ``chmod``) on every file and directory replay creates,
so it does not depend on the umask, and the recorded program's umask is never changed.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

__all__ = ["ENV_PERMISSIONS", "Permissions", "current", "dir_mode", "file_mode", "mkdir", "open_new", "set_file_mode", "write_new"]

ENV_PERMISSIONS = "REPLAY_PERMISSIONS"


class Permissions(enum.Enum):
    PRIVATE = "private"
    GROUP = "group"
    WORLD = "world"

    @classmethod
    def parse(cls, text: str) -> "Permissions":
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"permissions {text!r}: must be one of private, group, world") from None


_MODES = {
    Permissions.PRIVATE: (0o600, 0o700),
    Permissions.GROUP: (0o640, 0o750),
    Permissions.WORLD: (0o644, 0o755),
}


def current() -> Permissions:
    """The permissions this process creates recording files with (``$REPLAY_PERMISSIONS``)."""
    try:
        return Permissions.parse(os.environ.get(ENV_PERMISSIONS, "private"))
    except ValueError:
        return Permissions.PRIVATE  # validated where it enters (the CLI); never fail a recorder


def file_mode() -> int:
    return _MODES[current()][0]


def dir_mode() -> int:
    return _MODES[current()][1]


def open_new(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` with the recording file mode set on the new file."""
    fd = os.open(path, flags | os.O_CREAT, file_mode())
    try:
        os.fchmod(fd, file_mode())
    except OSError:
        pass  # a file system without modes (some FUSE mounts): the file is still ours
    return fd


def set_file_mode(path: str | os.PathLike[str]) -> None:
    try:
        os.chmod(path, file_mode())
    except OSError:
        pass


def mkdir(path: str | os.PathLike[str], *, exist_ok: bool = False, parents: bool = False) -> Path:
    """Create a recording directory with the recording directory mode (``FileExistsError`` if
    it exists, unless ``exist_ok``; an existing one keeps its mode)."""
    p = Path(path)
    if parents:
        p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p, dir_mode())
    except FileExistsError:
        if not exist_ok or not p.is_dir():
            raise
        return p
    try:
        os.chmod(p, dir_mode())
    except OSError:
        pass
    return p


def write_new(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a new file (replacing none: ``FileExistsError``), with the file mode,
    never through a symlink."""
    fd = open_new(path, os.O_WRONLY | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
        raise
    os.close(fd)
