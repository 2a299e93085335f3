"""Deferred imports: ``replay info`` and friends read only tables, and importing torch costs a
second or more; modules that need torch only for tensors bind it through ``LazyModule``."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LazyModule"]


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
