"""The program's own source files as they were when recorded: a script edited since (a print
added, a constant changed) computes something else, and a re-run runs the code as it is now.

Recorded once per process (the script run as ``__main__``) and once per step callable (the file
that defines it), as ``{path: digest}``; a re-run names the ones that changed or are gone."""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

__all__ = ["source_digests", "changed_sources", "step_source_file"]

# A file larger than this is not read (it is no script; a generated module, say).
_MAX_BYTES = 16 << 20


def _digest(path: str) -> str | None:
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            return None
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


def source_digests(paths: list[str | None]) -> dict[str, str]:
    """``{absolute path: digest}`` of the files that can be read (others are left out)."""
    out: dict[str, str] = {}
    for p in paths:
        if not p or not p.endswith(".py"):
            continue
        p = os.path.abspath(p)
        d = _digest(p)
        if d is not None:
            out[p] = d
    return out


def step_source_file(step: str) -> str | None:
    """The file defining ``module:qualname``'s module, if it is loaded from a file."""
    module = sys.modules.get(step.partition(":")[0])
    f = getattr(module, "__file__", None)
    return f if isinstance(f, str) else None


def changed_sources(recorded: Any) -> list[str]:
    """The recorded source files that differ now, by base name (``"serve.py (changed)"``,
    ``"serve.py (gone)"``). Data only: the recording names paths; nothing in it is run."""
    if not isinstance(recorded, dict):
        return []
    out = []
    for path, digest in sorted(recorded.items()):
        if not isinstance(path, str) or not isinstance(digest, str) or not os.path.isabs(path):
            continue
        now = _digest(path)
        if now != digest:
            out.append(f"{os.path.basename(path)} ({'gone' if now is None and not os.path.exists(path) else 'changed'})")
    return out
