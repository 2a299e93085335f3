"""Patching code the user did not change: post-import hooks and wrappers for named callables.

A target is named ``module:qualname``. When ``module`` is imported (or now, if it already is),
the callable at ``qualname`` is replaced by a wrapper. Methods are patched on their class, so
every instance is covered; an ``nn.Module`` class means its ``forward``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Callable

from replay.log import get_logger

__all__ = ["when_imported", "when_class_defined", "patch_callable", "resolve", "install_import_hooks"]

log = get_logger("replay.record")

_callbacks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()
_PATCHED = "__replay_wrapped__"


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so callbacks run right after the module executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
                return spec
            if spec is not None:
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _run_callbacks(module.__name__, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_finder = _Finder()


def install_import_hooks() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _run_callbacks(name: str, module: Any) -> None:
    with _lock:
        cbs = _callbacks.pop(name, [])
    for cb in cbs:
        try:
            cb(module)
        except Exception as e:  # noqa: BLE001 - instrumentation must never break an import
            log.warning("could not instrument %s: %s", name, e)


def when_imported(module: str, callback: Callable[[Any], None]) -> None:
    """Run ``callback(module)`` once ``module`` is imported (now, if it already is)."""
    mod = sys.modules.get(module)
    if mod is not None and getattr(mod, "__spec__", None) is not None and not _initialising(mod):
        callback(mod)
        return
    with _lock:
        _callbacks.setdefault(module, []).append(callback)
    install_import_hooks()


_class_callbacks: dict[str, list[tuple[str, Callable[[type], None]]]] = {}
_orig_build_class: Any = None


def _main_stem() -> str | None:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return argv0.rsplit("/", 1)[-1].removesuffix(".py") if argv0.endswith(".py") else None


def _build_class(func: Any, name: str, *bases: Any, **kw: Any) -> Any:
    cls = _orig_build_class(func, name, *bases, **kw)
    cbs = _class_callbacks.get(getattr(cls, "__qualname__", name)) if isinstance(cls, type) else None
    if cbs and cls.__module__ in ("__main__", "__mp_main__"):
        stem = _main_stem()
        for module, cb in cbs:
            # ``python -m pkg.mod`` runs pkg/mod.py as __main__: match on the last component.
            # ``--step __main__:Model.forward`` names it as the script calls itself.
            if module in ("__main__", "__mp_main__") or (stem is not None and (module == stem or module.rsplit(".", 1)[-1] == stem)):
                try:
                    cb(cls)
                except Exception as e:  # noqa: BLE001
                    log.warning("could not instrument %s.%s: %s", module, name, e)
    return cls


def when_class_defined(module: str, qualname: str, callback: Callable[[type], None]) -> None:
    """Run ``callback(cls)`` when the script run as ``module`` (``python module.py``, or a spawned
    child re-running it as ``__mp_main__``) defines class ``qualname``: such classes are never
    imported under ``module``, so the import hook alone would miss them."""
    global _orig_build_class
    import builtins

    with _lock:
        _class_callbacks.setdefault(qualname, []).append((module, callback))
        if _orig_build_class is None:
            _orig_build_class = builtins.__build_class__
            builtins.__build_class__ = _build_class


def _initialising(mod: Any) -> bool:
    spec = getattr(mod, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def resolve(target: str, root: Any = None) -> tuple[Any, str, Any]:
    """``module:qualname`` -> (owner object, attribute name, current value).

    ``root``: resolve the qualname from this object instead of importing the module: a class
    already in hand (the qualname's first component), or a module object (the script run as
    ``__main__``, whose own name is not importable)."""
    import types

    modname, _, qual = target.partition(":")
    parts = qual.split(".")
    if root is not None:
        owner: Any = root
        if not isinstance(root, types.ModuleType):
            parts = parts[1:]
    else:
        owner = importlib.import_module(modname)
    for p in parts[:-1]:
        owner = getattr(owner, p)
    name = parts[-1]
    value = _class_attribute(owner, name) if isinstance(owner, type) else getattr(owner, name)
    return owner, name, value


def _class_attribute(cls: type, name: str) -> Any:
    """``cls``'s attribute as its class body holds it (a staticmethod or classmethod object, not
    what getattr makes of it), from the first class of its MRO that defines it."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return getattr(cls, name)


def _own_original(owner: Any, name: str, value: Any) -> Any:
    """A subclass named on its own whose method is its base's, already patched for the base
    (``--step m:Draft --step m:Target``, ``class Draft(Target)``): the base's original, which the
    subclass gets its own wrapper around (before: the base's wrapper was taken as the subclass's,
    and the subclass's step "never ran")."""
    if isinstance(owner, type) and name not in owner.__dict__ and getattr(value, _PATCHED, False):
        return getattr(value, "__wrapped__", value)
    return value


def patch_callable(target: str, make_wrapper: Callable[[Callable[..., Any], str], Callable[..., Any]], *, root: Any = None) -> bool:
    """Replace the callable named ``target`` by ``make_wrapper(original, target)``. Idempotent."""
    import types

    owner, name, value = resolve(target, root)
    if root is not None and owner is root and not isinstance(root, (type, types.ModuleType)):
        raise TypeError(f"{target} does not name a method of a class")
    if isinstance(value, type):
        import torch.nn as nn

        if not issubclass(value, nn.Module):
            raise TypeError(f"{target} is a class but not an nn.Module: name a method or function")
        owner, name, value = value, "forward", _class_attribute(value, "forward")
    kind = None
    if isinstance(value, staticmethod):
        kind, value = staticmethod, value.__func__
    elif isinstance(value, classmethod):
        kind, value = classmethod, value.__func__
    value = _own_original(owner, name, value)
    if getattr(value, _PATCHED, False):
        return False
    if not callable(value):
        raise TypeError(f"{target} is not callable")
    wrapped = make_wrapper(value, target)
    functools.update_wrapper(wrapped, value)
    setattr(wrapped, _PATCHED, True)
    setattr(owner, name, kind(wrapped) if kind else wrapped)
    return True
