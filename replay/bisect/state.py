"""On-disk state of a configuration bisection, so that an interrupted one resumes.

The state is the bisection's request, its baseline and every probe already answered, in
``<recording>/results/bisect-state-r<R>-s<S>-<hash>.json``. The search itself is deterministic
given the answers, so resuming is running it again with answered probes read from the file:
only the probes not yet answered run. The file is rewritten (atomically) after every probe.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from replay.log import get_logger

__all__ = ["BisectState", "state_path"]

STATE_KIND = "bisect-state"
STATE_VERSION = 1

log = get_logger(__name__)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def state_path(recording: Path, key: dict[str, Any]) -> Path:
    h = hashlib.sha256(_canonical(key).encode()).hexdigest()[:12]
    return Path(recording) / "results" / f"bisect-state-r{key.get('rank')}-s{key.get('step')}-{h}.json"


class BisectState:
    """A mapping of answered probes (and the baseline) kept in a JSON file."""

    def __init__(self, recording: Path, key: dict[str, Any], *, fresh: bool = False) -> None:
        self.key = json.loads(_canonical(key))
        self.path = state_path(recording, key)
        self.writable = True
        self.resumed = False
        self.data: dict[str, Any] = {"kind": STATE_KIND, "version": STATE_VERSION, "key": self.key,
                                     "baseline": None, "probes": {}, "done": False}
        if fresh:
            self.path.unlink(missing_ok=True)
            return
        try:
            old = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable bisection state %s (%s)", self.path, e)
            return
        if isinstance(old, dict) and old.get("kind") == STATE_KIND and old.get("version") == STATE_VERSION and old.get("key") == self.key:
            self.data.update(old)
            self.resumed = bool(old.get("probes")) or old.get("baseline") is not None

    @property
    def probes(self) -> dict[str, Any]:
        return self.data["probes"]

    def save(self) -> None:
        if not self.writable:
            return
        tmp = self.path.with_suffix(".json.tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
            os.replace(tmp, self.path)  # a reader, or a kill, never sees half a file
        except OSError as e:
            self.writable = False
            log.warning("cannot keep bisection state in %s (%s): an interruption will start over", self.path, e)
