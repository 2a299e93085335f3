"""Per-parameter weight digests: moved to ``replay.core.weights`` (re-exported here)."""

from replay.core.weights import weight_digests  # noqa: F401

__all__ = ["weight_digests"]
