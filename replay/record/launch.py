"""Where the recorded program came from: what a re-run needs to start it again, from anywhere.

Stored once per rank in the target info, ``attrs["target"]["launch"]``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from replay import numerics
from replay.core.environment import env_digests
from replay.core.sources import source_digests
from replay.format.manifest import stdin_id

__all__ = ["launch_info", "main_name", "main_names", "module_name"]


def main_name() -> str | None:
    """The name the script run as ``__main__`` would have as a module: ``generate`` for
    ``python generate.py``, ``pkg.mod`` for ``python -m pkg.mod``; None in an interactive one."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) and spec.name != "__main__":
        return str(spec.name)
    f = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None)
    if not f:
        return None
    return Path(f).name.removesuffix(".py") or None


def main_names() -> set[str]:
    """Every name a ``--step MODULE:`` may use for the script being run."""
    names = {"__main__", "__mp_main__"}
    n = main_name()
    if n:
        names.add(n)
        names.add(n.rsplit(".", 1)[-1])
    return names


def module_name(mod: str) -> str:
    """A class's or function's ``__module__`` as a ``--step`` would name it."""
    if mod in ("__main__", "__mp_main__"):
        return main_name() or mod
    return mod


# Where the program was started: imported by the recorder's bootstrap before the program runs, so
# a program that calls os.chdir() before its loop is still re-launched from where it started
# (its argv names the script relative to this).
_START_CWD = os.getcwd()
# The environment it was started with, taken then for the same reason: a re-launch is compared
# with what the program started with, not with what it or torch set since (torch.compile sets
# TORCHINDUCTOR_CACHE_DIR; a program may set its own variables), which a re-launch sets again.
_START_ENV = env_digests(os.environ)


def launch_info() -> dict[str, Any]:
    main = sys.modules.get("__main__")
    f = getattr(main, "__file__", None)
    return {
        "argv": list(sys.argv),
        "executable": sys.executable,
        "interpreter_options": interpreter_options(getattr(sys, "orig_argv", [])),
        "cwd": _START_CWD,
        "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
        "main_file": os.path.abspath(f) if f else None,
        "main_name": main_name(),
        "env_numerics": numerics.env_numerics(),
        "env_digests": dict(_START_ENV),  # names and value digests, never values
        # A program's ``multiprocessing`` workers run the same script: a re-run takes over the
        # one of this name ("SpawnProcess-1"), not whichever calls the step first.
        "process_name": _process_name(),
        # A task pool's worker (``multiprocessing.Pool``, ``ProcessPoolExecutor``) runs whichever
        # task is free next: a re-run finds the recorded task by its model, not by the worker.
        "task_pool": task_pool(),
        # The script's digest: a re-run of a script edited since says so (``replay.core.sources``).
        "sources": source_digests([f]),
        # ``python -c CODE``: the code itself (sys.argv holds "-c" in its place), so that a
        # re-launch can run it again.
        "code": _command_code(getattr(sys, "orig_argv", [])),
        # What stdin this process was given (``dev:inode``): `replay record` keeps the command's
        # stdin only, and a process the program started with a stdin of its own (a worker fed
        # through a pipe) is told apart by this (``stdin_id`` in the manifest).
        "stdin_id": stdin_id(0),
    }


_MAX_CODE = 1 << 20


def _command_code(orig_argv: list[str]) -> str | None:
    """The program text of ``python [options] -c CODE ...``, or None."""
    n = len(interpreter_options(orig_argv))
    if len(orig_argv) > n + 2 and orig_argv[n + 1] == "-c" and len(orig_argv[n + 2]) <= _MAX_CODE:
        return orig_argv[n + 2]
    return None


def interpreter_options(orig_argv: list[str]) -> list[str]:
    """The options given to the interpreter itself (``python3 -O -W error script.py`` gives
    ``["-O", "-W", "error"]``): a re-launch passes them again, as they change what the program
    computes (``-O`` drops its asserts and ``if __debug__`` code)."""
    opts: list[str] = []
    i = 1
    while i < len(orig_argv):
        a = orig_argv[i]
        if a in ("-m", "-c", "-", "--") or not a.startswith("-"):
            break
        if a in ("-W", "-X") and i + 1 < len(orig_argv):
            opts += [a, orig_argv[i + 1]]
            i += 2
            continue
        opts.append(a)
        i += 1
    return opts


# The loops of the standard library's process pools that call a task: (module, function).
_POOL_LOOPS = {("multiprocessing.pool", "worker"), ("concurrent.futures.process", "_process_worker")}


def task_pool() -> str | None:
    """The module of the process pool whose worker loop this call runs under, or None."""
    f = sys._getframe(1)
    while f is not None:
        key = (f.f_globals.get("__name__"), f.f_code.co_name)
        if key in _POOL_LOOPS:
            return key[0]
        f = f.f_back
    return None


def _process_name() -> str | None:
    mp = sys.modules.get("multiprocessing")
    return None if mp is None else str(mp.current_process().name)
