"""Where ``replay record`` reads a recording's settings, and how it tells every Python process it
starts: one ``RecordConfig`` (``replay.record.config``) as one JSON object in the environment.

Settings come from three places, later ones winning: the defaults of ``RecordConfig``, the
``[tool.replay]`` table of the project's ``pyproject.toml``, and the command line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from replay.record.config import RecordConfig

__all__ = ["RecordConfig", "RecordSettings", "ENV_DIR", "ENV_SETTINGS", "load_pyproject_settings", "current"]

ENV_DIR = "REPLAY_RECORD_DIR"
ENV_SETTINGS = "REPLAY_RECORD_SETTINGS"

RecordSettings = RecordConfig
"""The former name of ``RecordConfig`` (one class now), kept for code that imports it."""

_KEYS = frozenset(RecordConfig.__dataclass_fields__)


def load_pyproject_settings(start: Path) -> dict[str, Any]:
    """The ``[tool.replay]`` table of the nearest pyproject.toml at or above ``start``, as
    ``RecordConfig`` keywords."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return {}
    for d in [start, *start.parents]:
        p = d / "pyproject.toml"
        if p.is_file():
            try:
                data = tomllib.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{p}: cannot read [tool.replay] ({e})") from None
            table = {k.replace("-", "_"): v for k, v in data.get("tool", {}).get("replay", {}).items()}
            # issue 16: keys read elsewhere: `trusted` by replay/trust.py, `permissions` by replay record
            table = {k: v for k, v in table.items() if k not in ("trusted", "permissions")}
            if isinstance(table.get("outputs"), list):
                # `outputs = [names]`: the older key for output_names (`outputs` is now the
                # digest/full mode of step outputs, a string).
                table["output_names"] = table.pop("outputs")
            unknown = sorted(set(table) - _KEYS)
            if unknown:
                raise ValueError(f"{p}: unknown [tool.replay] keys: {', '.join(unknown)}")
            return table
    return {}


def current() -> tuple[Path, RecordConfig] | None:
    """The settings this process was started with by ``replay record``, if any."""
    d = os.environ.get(ENV_DIR)
    s = os.environ.get(ENV_SETTINGS)
    if not d or not s:
        return None
    return Path(d), RecordConfig.from_env(s)
