"""Where a re-run's recorded code comes from: the ONE place that imports what a recording names.

A recording names code as ``module:qualname`` (its step, factory and probes). Importing such a
name runs the module's code, so every import a re-run makes goes through ``import_recorded``
(and ``resolve_recorded`` for probes, which wraps it): that is where the consent check of
``replay.trust`` goes (marked TRUST GATE below). ``info``, ``verify`` and ``report`` never get here.

The program's import context comes from the recording, not from the shell that runs ``replay
step``: the recorded script's directory (``python generate.py`` puts it first on ``sys.path``),
the recorded ``sys.path`` entries that exist here, and the script itself for ``__main__:NAME``.
``import_context`` is the one place that sets it up, so re-runs work from any directory without
``PYTHONPATH=.``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from replay.errors import FactoryError

__all__ = ["ImportContext", "import_context", "import_recorded", "resolve_recorded", "main_module"]

MAIN_ALIAS = "__replay_main__"


@dataclass(kw_only=True, slots=True, frozen=True)
class ImportContext:
    """Where the recorded program found its modules (``attrs["target"]["launch"]``)."""

    sys_path: tuple[str, ...] = ()
    cwd: str | None = None
    main_file: str | None = None  # the script run as __main__ (``python generate.py``)
    main_name: str | None = None  # the module run as __main__ (``python -m pkg.mod``), if one was
    recorded: bool = False  # the recording said where; False: the re-run's own sys.path only
    paths: tuple[str, ...] = field(default=())  # what import_context puts on sys.path, in order

    @classmethod
    def from_target(cls, target: Any) -> "ImportContext":
        launch = target.get("launch") if isinstance(target, dict) else None
        if not isinstance(launch, dict):
            return cls()
        def text(key: str) -> str | None:
            v = launch.get(key)
            return v if isinstance(v, str) and v else None

        sys_path = tuple(p for p in launch.get("sys_path") or [] if isinstance(p, str))
        cwd, main_file, main_name = text("cwd"), text("main_file"), text("main_name")
        paths: list[str] = []
        if main_file:
            paths.append(str(Path(main_file).parent))  # what `python script.py` puts first
        for p in sys_path:
            # "" is the program's working directory (`python -c`, `python -m`): the recorded cwd.
            full = (cwd or "") if p == "" else (p if os.path.isabs(p) or cwd is None else os.path.join(cwd, p))
            if full and full not in paths and os.path.isdir(full):
                paths.append(full)
        return cls(sys_path=sys_path, cwd=cwd, main_file=main_file, main_name=main_name, recorded=True, paths=tuple(paths))


@contextlib.contextmanager
def import_context(ctx: ImportContext) -> Iterator[None]:
    """Put the recorded program's module directories on ``sys.path`` (first), for the re-run.

    Entries already on ``sys.path`` stay where they are; the added ones are removed on exit
    (modules already imported stay imported, as they would in the program)."""
    added = [p for p in ctx.paths if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def main_module(ctx: ImportContext, name: str) -> ModuleType:
    """The recorded program's ``__main__``, imported as a module (its ``if __name__ ==
    "__main__"`` block does not run): by its module name (``-m``), or by the script's path."""
    if ctx.main_name and ctx.main_name != "__main__":
        return _import_module(ctx.main_name, name)
    if not ctx.main_file or not os.path.isfile(ctx.main_file):
        raise FactoryError(f"{name} names the recorded program's __main__, and the recording does not say which script "
                           "that was (or it is not here): re-record with this replay, or pass --factory")
    stem = Path(ctx.main_file).stem
    existing = sys.modules.get(stem)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == os.path.abspath(ctx.main_file):
        return existing
    if MAIN_ALIAS in sys.modules and getattr(sys.modules[MAIN_ALIAS], "__file__", None) == ctx.main_file:
        return sys.modules[MAIN_ALIAS]
    _refuse_a_program_file(Path(ctx.main_file), stem, name)
    spec = importlib.util.spec_from_file_location(MAIN_ALIAS, ctx.main_file)
    if spec is None or spec.loader is None:
        raise FactoryError(f"cannot load {ctx.main_file} for {name}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MAIN_ALIAS] = mod
    try:
        spec.loader.exec_module(mod)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - user code failed while importing
        sys.modules.pop(MAIN_ALIAS, None)
        raise FactoryError(f"loading {ctx.main_file} for {name} failed: {e.__class__.__name__}: {e}") from None
    return mod


def _import_module(module: str, name: str) -> ModuleType:
    if module not in sys.modules:
        _refuse_a_program(module, name)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise FactoryError(f"cannot import {module} for {name} ({e}); is the package installed here?") from None
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - user code failed while importing (issue 16: exits too)
        raise FactoryError(f"importing {module} for {name} failed: {e.__class__.__name__}: {e}") from None


def _refuse_a_program(module: str, name: str) -> None:
    """Refuse to import a module whose top level runs a program (a script's decode loop outside
    ``if __name__ == "__main__":``): importing it would run that program inside replay, write
    into its recording and exit or kill replay with it. Read, never run, to tell."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return  # the import itself says why
    origin = getattr(spec, "origin", None) if spec is not None else None
    if isinstance(origin, str) and origin.endswith(".py") and os.path.isfile(origin):
        _refuse_a_program_file(Path(origin), module, name)


def _refuse_a_program_file(path: Path, module: str, name: str) -> None:
    from replay.rerun.script_check import program_statement

    line = program_statement(path)
    if line is not None:
        raise FactoryError(f"{name}: importing {module} ({path}) would run its program: its top level runs {line} outside "
                           "`if __name__ == \"__main__\":`; pass --factory naming a module that builds the model without running "
                           "the program, or move the loop under that guard")


def import_recorded(name: str, what: str, ctx: ImportContext | None = None) -> Any:
    """Import the object a recording names as ``module:qualname`` (``what``: step, factory, probe);
    ``module:`` is the module itself. ``__main__:NAME`` (and the script's own module name) resolve to the recorded script."""
    if not isinstance(name, str) or ":" not in name:
        raise FactoryError(f"{what} {name!r} is not of the form module:qualname")
    module, _, qual = name.partition(":")
    ctx = ctx or ImportContext()
    # TRUST GATE: every import of recorded code passes here; replay.trust.admit (issue 16) is
    # called by build_target and the CLI (admit_part) before anything reaches this point.
    with import_context(ctx):
        if module in ("__main__", "__mp_main__"):
            obj: Any = main_module(ctx, f"{what} {name}")
        else:
            obj = _import_module(module, f"{what} {name}")
    for part in qual.split(".") if qual else []:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"{module} has no {qual} ({what} {name})") from None
    return obj


def resolve_recorded(name: str, what: str, ctx: ImportContext | None = None) -> tuple[Any, str, Any]:
    """``module:qualname`` -> (owner, attribute, current value), importing through ``import_recorded``."""
    module, _, qual = name.partition(":")
    head, _, last = qual.rpartition(".")
    owner = import_recorded(f"{module}:{head}", what, ctx)  # the module itself when ``head`` is empty
    value = owner.__dict__[last] if isinstance(owner, type) and last in owner.__dict__ else getattr(owner, last)
    return owner, last, value
