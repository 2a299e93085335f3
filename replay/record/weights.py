"""Per-parameter weight digests and shard layouts: moved to ``replay.core.weights`` (re-exported
here), since the re-run checks rebuilt weights with the same function."""

from replay.core.weights import param_layout, weight_digests  # noqa: F401

__all__ = ["param_layout", "weight_digests"]
