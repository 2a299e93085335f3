"""Results saved beside a recording by ``replay step`` and ``replay bisect``, read back as data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from replay.states import RESULTS_FORMAT_VERSION

__all__ = ["load_results"]

_MAX_RESULT_BYTES = 4 << 20
_MAX_RESULTS = 200


def load_results(recording: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``<recording>/results/*.json`` written by ``replay step`` and ``replay bisect``.

    Data only: parsed as JSON, never executed. Unreadable, oversized or non-object files are
    skipped and named in the second list.
    """
    folder = Path(recording) / "results"
    if folder.is_symlink():  # issue 16: never read (and embed in a shareable page) files from outside the recording
        return [], ["results: a symbolic link out of the recording, not read"]
    if not folder.is_dir():
        return [], []
    results, skipped = [], []
    for p in sorted(folder.glob("*.json"))[:_MAX_RESULTS]:
        if p.is_symlink():  # issue 16: as above
            skipped.append(f"{p.name}: a symbolic link, not read")
            continue
        try:
            if p.stat().st_size > _MAX_RESULT_BYTES:
                skipped.append(f"{p.name}: larger than {_MAX_RESULT_BYTES >> 20} MiB")
                continue
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append(f"{p.name}: not readable JSON ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})")
            continue
        if not isinstance(obj, dict):
            skipped.append(f"{p.name}: not a JSON object")
            continue
        if obj.get("kind") == "bisect-state" or p.name.startswith("bisect-state-"):
            continue  # an interrupted bisection's working state, not a result
        version = obj.get("format_version", 1)  # results saved before versions were written are version 1
        if not isinstance(version, int) or isinstance(version, bool) or version > RESULTS_FORMAT_VERSION:
            skipped.append(f"{p.name}: written by a newer replay (results format_version {version!r}); "
                           f"this one reads up to {RESULTS_FORMAT_VERSION}")
            continue
        obj = dict(obj)
        obj["_file"] = p.name
        obj.setdefault("_mtime", p.stat().st_mtime)
        results.append(obj)
    results.sort(key=lambda o: o.get("_mtime", 0) if isinstance(o.get("_mtime"), (int, float)) else 0)
    return results, skipped
