"""Deferred imports: ``replay info`` and friends read only tables, and importing torch costs a
second or more; modules that need torch only for tensors bind it through ``LazyModule``."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule", "lazy_exports"]


class LazyModule:
    """Stands in for ``import name as alias`` in a module namespace until first used; then the
    real module replaces it there, so later accesses cost nothing."""

    def __init__(self, name: str, namespace: dict[str, Any], alias: str | None = None) -> None:
        self._name = name
        self._namespace = namespace
        self._alias = alias or name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._namespace[self._alias] = module
        return getattr(module, attr)


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]):  # noqa: ANN201 - a module __getattr__
    """A package's ``__getattr__`` (PEP 562) that imports each public name from the module
    ``exports`` names for it on first use, then keeps it in the package's ``namespace``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
