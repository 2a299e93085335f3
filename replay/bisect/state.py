"""On-disk state of a configuration bisection, so that an interrupted one resumes.

The state is the bisection's request, its baseline and every probe already answered, in
``<recording>/results/bisect-state-r<R>-s<S>-<hash>.json``. The search itself is deterministic
given the answers, so resuming is running it again with answered probes read from the file:
only the probes not yet answered run. The file is rewritten (atomically) after every probe.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from replay.format.results import read_inside, remove_inside, write_inside  # issue 16
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
        # issue 16: the state is read, written and removed inside <recording>/results only, never
        # through a symbolic link out of the recording (replay/format/results.py).
        self._recording = Path(recording)
        if fresh:
            remove_inside(self._recording, self.path.name)
            return
        try:
            raw = read_inside(self._recording, self.path.name)
            if raw is None:
                return
            old = json.loads(raw.decode("utf-8"))
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
        try:
            # issue 16: whole or not at all, and never through a link (replay/format/results.py)
            write_inside(self._recording, self.path.name, json.dumps(self.data, indent=1, default=str).encode("utf-8"))
        except OSError as e:
            self.writable = False
            log.warning("cannot keep bisection state in %s (%s): an interruption will start over", self.path, e)
