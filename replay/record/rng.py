"""Random number generator capture and restore: moved to ``replay.core.rng`` (re-exported here)."""

from replay.core.rng import capture_rng, restore_rng  # noqa: F401

__all__ = ["capture_rng", "restore_rng"]
