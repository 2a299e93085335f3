"""Results saved beside a recording (`results/*.json`) by `replay step` and `replay bisect`, for `replay report`.

Files a command writes into a recording never follow a symbolic link out of it: a recording is
handed from person to person, and a ``results`` entry that is a link to ``~/.ssh`` must not make
``replay step`` write there (or ``replay bisect`` read its state from there). The ``results``
directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and every file in it is created, read and
renamed relative to that descriptor, with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from replay.format import perms

__all__ = ["save_result", "write_inside", "read_inside", "remove_inside", "results_dir_fd", "RESULTS", "MAX_RESULT_BYTES"]

RESULTS = "results"
MAX_RESULT_BYTES = 64 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def results_dir_fd(recording: Path, *, create: bool) -> int:
    """An fd of ``<recording>/results``, which must be a real directory (not a link); created
    (owner-only unless widened) when ``create``. Raises OSError (ELOOP/ENOTDIR for a link)."""
    rec_fd = os.open(recording, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        created = False
        if create:
            try:
                os.mkdir(RESULTS, perms.dir_mode(), dir_fd=rec_fd)
                created = True
            except FileExistsError:
                pass
        fd = os.open(RESULTS, _DIR_FLAGS, dir_fd=rec_fd)
        if created:
            try:
                os.fchmod(fd, perms.dir_mode())  # the mode asked for, whatever the umask
            except OSError:
                pass
        return fd
    finally:
        os.close(rec_fd)


def write_inside(recording: Path, name: str, data: bytes, *, replace: bool = True) -> Path:
    """Write ``<recording>/results/<name>`` whole or not at all, never through a link.

    ``replace=False``: ``FileExistsError`` if it exists. Raises OSError when it cannot be written
    (``results`` a link: ELOOP or ENOTDIR).
    """
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    dfd = results_dir_fd(recording, create=True)
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     perms.file_mode(), dir_fd=dfd)
        try:
            os.fchmod(fd, perms.file_mode())
            view = memoryview(data)
            while view.nbytes:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        try:
            if replace:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)
    return Path(recording) / RESULTS / name


def read_inside(recording: Path, name: str, *, limit: int = MAX_RESULT_BYTES) -> bytes | None:
    """The bytes of ``<recording>/results/<name>``; None if absent. A link (the directory or the
    file), a non-regular file or one over ``limit`` bytes raises ValueError."""
    try:
        dfd = results_dir_fd(recording, create=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"{Path(recording) / RESULTS} is a symbolic link or not a directory") from None
        raise
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{name} is a symbolic link") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{name} is not a regular file")
            chunks, total = [], 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                total += len(b)
                if total > limit:
                    raise ValueError(f"{name} is larger than {limit} bytes")
                chunks.append(b)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def remove_inside(recording: Path, name: str) -> None:
    """Remove ``<recording>/results/<name>`` (a link is removed itself, never followed)."""
    try:
        dfd = results_dir_fd(recording, create=False)
    except OSError:
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dfd)


def save_result(recording: Path, data: dict[str, Any]) -> Path | None:
    """Write ``data`` (a result's ``to_json()``) to ``<recording>/results/``; None if it cannot be.

    The name says what it is: ``<kind>-r<rank>-s<step>-<time>.json`` (rank and step when it has them). The file appears whole or
    not at all (written aside, then linked into place), so the report never reads half a result;
    it never follows a link out of the recording.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # A result of no one rank or step (a bisection across ranks, over all steps) names neither.
    where = "".join(f"-{k}{data[key]}" for k, key in (("r", "rank"), ("s", "step")) if data.get(key) is not None)
    base = f"{data['kind']}{where}-{stamp}"
    base = "".join(c if c.isalnum() or c in "-_.," else "_" for c in base)[:200]
    body = json.dumps(data, indent=1, default=str).encode("utf-8")
    for n in range(1000):  # two results in one second: keep both
        name = f"{base}.json" if n == 0 else f"{base}-{n}.json"
        try:
            return write_inside(Path(recording), name, body, replace=False)
        except FileExistsError:
            continue
        except (OSError, ValueError):
            return None
    return None
