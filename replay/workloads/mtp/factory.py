"""Rebuild an engine from its recorded config: the entry point `replay` names by string."""

from __future__ import annotations

from typing import Any

from replay.workloads.mtp.config import EngineConfig
from replay.workloads.mtp.engine import Engine

__all__ = ["build_engine"]


def build_engine(
    config: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    device: str,
    options: dict[str, Any] | None = None,
) -> Engine:
    """Build rank ``rank`` of ``world_size`` from ``config`` (an `EngineConfig.to_dict()`).

    ``options`` overrides config fields (the toggles a bisection flips) and may hold
    ``tuner_choices``, a ``{key: tactic}`` dict (from `Engine.tuner_choices()`) forcing those
    tactics, so a re-run computes what the recorded rank computed. Weights depend only on the seed
    (and the rank's shard under ``tp``), so any rank can be rebuilt alone. This never initialises
    torch.distributed: with ``world_size > 1`` the caller provides the default process group.
    """
    overrides = dict(options or {})
    tuner_choices = overrides.pop("tuner_choices", None)
    if tuner_choices is not None and not isinstance(tuner_choices, dict):
        raise ValueError(
            f"options['tuner_choices'] must be a dict of key -> tactic, got {type(tuner_choices).__name__}"
        )
    cfg = EngineConfig.from_dict({**config, **overrides, "device": device})
    return Engine(cfg, rank=rank, world_size=world_size, device=device, tuner_choices=tuner_choices)
