"""A re-launched program's file writes go to a scratch directory, never over the user's files.

``replay step`` on a recording with no factory starts the recorded program again
(``replay.rerun.relaunch``), and the program runs its own start-up once more: the
``open("generations.jsonl", "w")`` that made its output when it was recorded would empty that
output now, and a debugger must not destroy the user's files. So, in the re-launched program
only (never while recording), the Python-level calls that change a file are pointed at its
mirror under a scratch directory, which ``replay step`` deletes afterwards:

* ``open``/``io.open`` (so pathlib, logging, numpy) and ``os.open`` for writing, appending,
  creating or truncating, and ``torch.save`` to a path, write the mirror; an append (or a
  read-write open) starts from a copy of the original;
* ``os.replace``/``os.rename`` move into the mirror (a user's file is copied, never moved);
  ``os.remove``/``os.unlink``/``os.rmdir`` of a user's file leave it in place (the program is told
  it is gone); ``os.mkdir`` (and so ``os.makedirs``) makes the mirror;
* reads (``open``, ``os.open``, ``os.stat``, so ``os.path.exists``) of a path written in this
  run find the mirror, what the program wrote; reads of other files are unchanged; a directory
  made in this run can be entered and listed (``os.chdir``, ``os.listdir``, ``os.scandir``).

Written for real: the re-launch's own files, devices and FIFOs (``/dev/null``), the caches that
compilers hand to their own subprocesses (inductor's, Triton's, ``~/.cache``), and entries of the
temporary directory that this process makes new (``tempfile``'s: nothing of the user's is there,
and a compiler reads them back in another process). Not redirected: writes made by C extensions
(h5py, safetensors) or by subprocesses that are not Python (a Python one gets the same bootstrap);
and such a reader of a file the program wrote in this run reads the original. A directory of
the user's is listed as it is, without what the program wrote into it. Whatever fails in here
makes the real call instead: the re-launch never fails because of it.
"""

from __future__ import annotations

import builtins
import errno
import functools
import getpass
import io
import os
import re
import shutil
import stat
import tempfile
from typing import Any, Callable, Iterable

__all__ = ["count_files", "install"]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_SYSTEM = ("/dev", "/proc", "/sys")
_real_lstat = os.lstat  # the sandbox's own look-ups go around its wrappers
_real_stat = os.stat
_box: "_Sandbox | None" = None


def install(scratch: str, *, keep: Iterable[str] = ()) -> None:
    """Point this process's file writes at mirrors under ``scratch``; paths under ``keep`` (and
    the caches and devices above) are written for real."""
    global _box
    if _box is not None:
        return
    box = _box = _Sandbox(scratch, [*keep, *_SYSTEM, *_cache_roots()])
    builtins.open = io.open = _open(box, builtins.open)
    os.open = _os_open(box, os.open)
    os.replace, os.rename = _move(box, os.replace), _move(box, os.rename)
    os.remove, os.unlink = _remove(box, os.remove), _remove(box, os.unlink)
    os.rmdir = _remove(box, os.rmdir, rmdir=True)
    os.mkdir = _mkdir(box, os.mkdir)
    for name in ("stat", "lstat", "chmod", "utime", "access"):  # so exists(), shutil.copy's copymode
        setattr(os, name, _mapped(box, getattr(os, name)))
    for name in ("chdir", "listdir", "scandir"):  # a directory made in this run can be entered and listed
        setattr(os, name, _made_dir(box, getattr(os, name)))
    _cover_torch(box)


def count_files(scratch: str) -> int:
    """How many files the re-launched program wrote (those under ``scratch``)."""
    return sum(len(files) for _, _, files in os.walk(scratch))


def _cache_roots() -> list[str]:
    """Caches whose files compilers and loaders read back from other processes or C code."""
    env, home = os.environ, os.path.expanduser("~")
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names inductor's default
    except Exception:  # noqa: BLE001 - no user name: that default cache is not kept apart
        user = ""
    roots = [env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
             env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or home, ".triton"),
             env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
             env.get("HF_HOME", ""), env.get("TORCH_HOME", ""), env.get("CUDA_CACHE_PATH", "")]
    return [r for r in roots if r]


def _lexists(p: str) -> bool:
    try:
        _real_lstat(p)
        return True
    except (OSError, ValueError):
        return False


def _isdir(p: str) -> bool:
    try:
        return stat.S_ISDIR(_real_stat(p).st_mode)
    except (OSError, ValueError):
        return False


def _isfile(p: str) -> bool:
    try:
        return stat.S_ISREG(_real_stat(p).st_mode)
    except (OSError, ValueError):
        return False


class _Sandbox:
    """Where each path of the program is written: the mirror, or the path itself."""

    def __init__(self, scratch: str, keep: list[str]) -> None:
        self.scratch = os.path.abspath(scratch)
        roots = [self.scratch, *keep]
        self.roots = tuple({os.path.abspath(r) for r in roots} | {os.path.realpath(r) for r in roots})
        self.tmp = os.path.abspath(tempfile.gettempdir())
        self.made: set[str] = set()  # entries of the temporary directory this process made
        self.removed: set[str] = set()  # user's paths the program removed (they stay)

    def guard(self, plan: Callable[..., Any], path: Any, *args: Any, **kwargs: Any) -> Any:
        """``plan(path, ...)``, or ``path`` unchanged (the real call) if anything fails in it."""
        try:
            return plan(path, *args, **kwargs)
        except Exception:  # noqa: BLE001 - the program's call must go on as it would have
            return path

    def absolute(self, path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):
            return None  # a file descriptor, already open
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return os.path.abspath(p)

    def mirror(self, p: str) -> str:
        return self.scratch + p

    def kept(self, p: str) -> bool:
        """Whether ``p`` is written for real."""
        if any(p == r or p.startswith(r + os.sep) for r in self.roots):
            return True
        try:
            mode = _real_stat(p).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return True  # a device, a FIFO, a socket: the real call does what it did
        except (OSError, ValueError):
            pass
        return self._new_temp(p)

    def _new_temp(self, p: str) -> bool:
        """Whether ``p`` is inside an entry of the temporary directory that this process made."""
        if not p.startswith(self.tmp + os.sep):
            return False
        top = os.path.join(self.tmp, p[len(self.tmp) + 1:].split(os.sep, 1)[0])
        if top in self.made:
            return True
        if _lexists(top) or _lexists(self.mirror(top)):
            return False
        self.made.add(top)
        return True

    def has_dir(self, d: str) -> bool:
        return (_isdir(d) and d not in self.removed) or _isdir(self.mirror(d))

    def read_path(self, path: Any, dir_fd: int | None = None) -> Any:
        """The mirror of a path written (or removed) in this run, else the path."""
        p = self.absolute(path, dir_fd)
        if p is None:
            return path
        m = self.mirror(p)
        return m if p in self.removed or _lexists(m) else path

    def made_dir(self, path: Any) -> Any:
        """The mirror of a directory the program made in this run, else the path (a directory of
        the user's is entered and listed as it is)."""
        p = self.absolute(path)
        if p is None or (_isdir(p) and p not in self.removed):
            return path
        m = self.mirror(p)
        return m if _isdir(m) else path

    def write_path(self, path: Any, dir_fd: int | None = None, *, copy: bool = False, exclusive: bool = False) -> Any:
        """Where a write of ``path`` goes: its mirror (made ready), or the path itself."""
        p = self.absolute(path, dir_fd)
        if p is None or self.kept(p) or _isdir(p):
            return path  # a directory: the real call refuses, as it did
        m = self.mirror(p)
        if not _lexists(m) and p not in self.removed:
            if exclusive and _lexists(p):
                return path  # the real call refuses, changing nothing
            if not self.has_dir(os.path.dirname(p)):
                return path  # the real call says the directory is missing
            os.makedirs(os.path.dirname(m), exist_ok=True)
            if copy and _isfile(p):
                shutil.copy2(p, m)  # an append continues the original
        self.removed.discard(p)
        return m

    def for_open(self, file: Any, mode: Any) -> Any:
        text = str(mode)
        if not any(c in text for c in "wax+"):
            return self.read_path(file)
        return self.write_path(file, copy="a" in text or "r" in text, exclusive="x" in text)

    def for_os_open(self, path: Any, flags: int, dir_fd: int | None) -> Any:
        if not flags & _WRITE_FLAGS:
            return self.read_path(path, dir_fd)
        return self.write_path(path, dir_fd, copy=not flags & os.O_TRUNC,
                               exclusive=bool(flags & os.O_CREAT and flags & os.O_EXCL))

    def for_mkdir(self, path: Any, dir_fd: int | None) -> Any:
        p = self.absolute(path, dir_fd)
        if p is None or self.kept(p):
            return path
        m = self.mirror(p)
        if _lexists(m):
            return m  # the real call says it exists
        if (_lexists(p) and p not in self.removed) or not self.has_dir(os.path.dirname(p)):
            return path  # the real call says it exists, or that its parent is missing
        os.makedirs(os.path.dirname(m), exist_ok=True)
        self.removed.discard(p)
        return m

    def for_remove(self, path: Any, dir_fd: int | None, rmdir: bool) -> Any:
        """What to remove: the mirror, the path itself, or None (a user's file: it stays)."""
        p = self.absolute(path, dir_fd)
        if p is None or self.kept(p):
            return path
        m = self.mirror(p)
        if _lexists(m) or p in self.removed:
            if _lexists(p):
                self.removed.add(p)
            return m  # (a missing mirror: the real call says it is gone)
        if not _lexists(p) or _isdir(p) != rmdir:
            return path  # the real call fails as it would have, changing nothing
        self.removed.add(p)
        return None

    def for_move(self, src: Any, dst: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, bool]:
        """(source, target, copy): a user's file is copied to the target, never moved."""
        s, d = self.absolute(src, kwargs.get("src_dir_fd")), self.absolute(dst, kwargs.get("dst_dir_fd"))
        if s is None or d is None or (self.kept(s) and self.kept(d)):
            return src, dst, False
        source = self.read_path(s)
        if source == s and not _lexists(s):
            return src, dst, False  # the real call says the source is missing
        target = d if self.kept(d) else self.write_path(d)
        if target == d and not self.kept(d):
            return src, dst, False  # no mirror could be made: the real call
        if source != s and _lexists(s) or source == s and not self.kept(s):
            self.removed.add(s)
        self.removed.discard(d)
        return source, target, source == s and not self.kept(s)


def _open(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - it is open
        return real(box.guard(box.for_open, file, mode), mode, *args, **kwargs)

    return open


def _os_open(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def open(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - it is os.open
        return real(box.guard(box.for_os_open, path, flags, kwargs.get("dir_fd")), flags, *args, **kwargs)

    return open


def _mkdir(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def mkdir(path: Any, *args: Any, **kwargs: Any) -> Any:
        return real(box.guard(box.for_mkdir, path, kwargs.get("dir_fd")), *args, **kwargs)

    return mkdir


def _remove(box: _Sandbox, real: Any, *, rmdir: bool = False) -> Any:
    @functools.wraps(real)
    def remove(path: Any, *args: Any, **kwargs: Any) -> Any:
        target = box.guard(box.for_remove, path, kwargs.get("dir_fd"), rmdir)
        return None if target is None else real(target, *args, **kwargs)

    return remove


def _move(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def move(src: Any, dst: Any, **kwargs: Any) -> Any:
        try:
            source, target, copy = box.for_move(src, dst, kwargs)
        except Exception:  # noqa: BLE001 - the program's call must go on as it would have
            source, target, copy = src, dst, False
        if copy:
            (shutil.copytree if _isdir(source) else shutil.copy2)(source, target)
            return None
        try:
            return real(source, target, **kwargs)
        except OSError as e:
            if e.errno != errno.EXDEV or source is src:
                raise
            shutil.move(source, target)  # the scratch directory is on another file system
            return None

    return move


def _mapped(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def mapped(path: Any, *args: Any, **kwargs: Any) -> Any:
        return real(box.guard(box.read_path, path, kwargs.get("dir_fd")), *args, **kwargs)

    return mapped


def _made_dir(box: _Sandbox, real: Any) -> Any:
    @functools.wraps(real)
    def in_dir(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
        return real(box.guard(box.made_dir, path), *args, **kwargs)

    return in_dir


def _cover_torch(box: _Sandbox) -> None:
    """``torch.save`` to a path writes it from C++: the path is pointed at the mirror first."""
    try:
        import torch
        import torch.serialization
    except Exception:  # noqa: BLE001 - no torch: nothing of it to cover
        return
    real = torch.save

    @functools.wraps(real)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, bytes, os.PathLike)):
            f = box.guard(box.write_path, f)
        return real(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = save  # type: ignore[assignment]
