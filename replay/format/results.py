"""Results saved beside a recording (`results/*.json`) by `replay step` and `replay bisect`, for `replay report`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["save_result"]


def save_result(recording: Path, data: dict[str, Any]) -> Path | None:
    """Write ``data`` (a result's ``to_json()``) to ``<recording>/results/``; None if it cannot be.

    The name says what it is: ``<kind>-r<rank>-s<step>-<time>.json``. The file appears whole or
    not at all (written aside, then renamed), so the report never reads half a result.
    """
    folder = Path(recording) / "results"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{data['kind']}-r{data.get('rank', 'x')}-s{data.get('step', 'x')}-{stamp}.json"
    path = folder / name
    try:
        folder.mkdir(exist_ok=True)
        n = 1
        while path.exists():  # two results in one second: keep both
            path = folder / name.replace(".json", f"-{n}.json")
            n += 1
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, path)
        return path
    except OSError:
        return None
