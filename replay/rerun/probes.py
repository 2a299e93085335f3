"""Probes in a re-run: the callables a recording probed are wrapped again, so their outputs
(recorded as fields of the step) can be compared, even for a step that raised."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

from replay.core.outputs import name_outputs
from replay.rerun.imports import ImportContext, resolve_recorded

__all__ = ["installed_probes"]


@contextlib.contextmanager
def installed_probes(probes: list[tuple[str, tuple[str, ...]]], sink: Callable[[str, dict[str, Any]], None],
                     imports: ImportContext | None = None) -> Iterator[None]:
    """Wrap each ``module:qualname`` probe so that its outputs go to ``sink(label, outputs)``."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for target, names in probes:
            try:
                owner, attr, value = resolve_recorded(target, "probe", imports)
            except Exception:  # noqa: BLE001 - a probe that no longer exists is just not compared
                continue
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            label = target.partition(":")[2].split(".")[-1]
            sig = inspect.signature(fn)

            def wrapper(*args: Any, _fn: Any = fn, _label: str = label, _names: tuple[str, ...] = tuple(names), _sig: Any = sig, **kwargs: Any) -> Any:
                out = _fn(*args, **kwargs)
                sink(_label, name_outputs(out, _names))
                # As when recording: a probe's ``logits`` argument is the step's logits.
                try:
                    lg = _sig.bind(*args, **kwargs).arguments.get("logits")
                except TypeError:
                    lg = None
                if lg is not None:
                    sink("", {"logits": lg})
                return out

            new: Any = wrapper
            if isinstance(value, staticmethod):
                new = staticmethod(wrapper)
            elif isinstance(value, classmethod):
                new = classmethod(wrapper)
            saved.append((owner, attr, value))
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
