"""What a configuration bisection is asked and what it answers (``replay.bisect.config`` searches).

Kept apart from the search so that the CLI, the API and the report read these types without the
search's imports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as _field
from enum import StrEnum
from typing import Any

from replay.errors import UsageError
from replay.states import BisectStatus, ProbeOutcome, ResultKind

__all__ = ["CRITERIA", "Change", "ConfigBisectSettings", "ConfigBisection", "Criterion", "ProbeRecord"]


class Criterion(StrEnum):
    """What "the step matches" means in a configuration bisection (see ``replay.bisect.config``)."""

    RANKS = "ranks"  # rank R and a reference rank re-run the reference's data: same bits
    EAGER = "eager"  # rank R as a CUDA graph and eagerly: same bits
    LIVE = "live"  # every rank at once, live collectives: all the same bits
    REPRODUCE = "reproduce"  # rank R alone: the re-run gives the bits it recorded


CRITERIA = tuple(c.value for c in Criterion)


@dataclass(kw_only=True, slots=True)
class ConfigBisectSettings:
    """What ``replay bisect --config`` is asked; the click options map onto these fields."""

    rank: int | None = None
    """The rank whose step diverges (None: the odd rank at the first divergence; ``replay.api``)."""
    step: int | None = None
    """The step to make match (None: the first divergence; ``replay.api``)."""
    toggles: list[str] | None = None
    """Toggles to try, ``name`` or ``name=JSON`` (another value than recorded); None: all declared."""
    criterion: str | None = None
    """``ranks``, ``eager``, ``live`` or ``reproduce`` (see ``replay.bisect.config``); None: chosen from the recording."""
    against: int | None = None
    """With ``ranks``: the reference rank (default: the lowest rank of the majority at the step)."""
    device: str = "cpu"
    """Where probes run: ``cpu``, or ``cuda:N`` (with ``live``, ranks go to cuda:0..N-1)."""
    factory: str | None = None
    """Rebuild the target with this factory instead of the recorded one."""
    options: dict[str, Any] = _field(default_factory=dict)
    """Toggle values applied to every probe, the baseline included (``--set``)."""
    max_probes: int | None = None
    """Stop after this many new probes (the state is kept: run again to resume)."""
    fresh: bool = False
    """Forget the saved state of this bisection and start over."""
    timeout_s: float = 600.0
    """Seconds one probe may take."""

    def __post_init__(self) -> None:
        if self.criterion is not None and self.criterion not in CRITERIA:
            raise UsageError(f"--criterion {self.criterion!r}: use one of {', '.join(CRITERIA)}")
        if self.max_probes is not None and self.max_probes < 1:
            raise UsageError("--max-probes must be at least 1")
        if self.against is not None and self.criterion not in (None, Criterion.RANKS):
            raise UsageError("--against names the reference rank of the ranks criterion; leave it out with --criterion "
                             f"{self.criterion}")
        if self.timeout_s <= 0:
            raise UsageError("--probe-timeout must be positive")


@dataclass(frozen=True, slots=True)
class Change:
    """Toggle ``name`` set to ``value`` (recorded: ``was``)."""

    name: str
    value: Any
    was: Any
    shown: str = ""  # how the value reads, where its JSON would not (tuner choices)

    @property
    def label(self) -> str:
        return f"{self.name}={self.shown or json.dumps(self.value, default=str)}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "was": self.was, "label": self.label}


@dataclass(slots=True)
class ProbeRecord:
    toggles: list[str]
    outcome: ProbeOutcome
    cached: bool
    seconds: float = 0.0
    error: str | None = None
    sides: list[dict[str, Any]] = _field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"toggles": self.toggles, "outcome": self.outcome, "cached": self.cached,
                "seconds": round(self.seconds, 3), "error": self.error,
                "sides": [{k: s.get(k) for k in ("label", "rank", "mode", "digests", "reproduces", "error")} for s in self.sides]}


@dataclass(slots=True)
class ConfigBisection:
    recording: str
    part: str
    rank: int
    step: int
    criterion: Criterion
    reference: int | None
    status: BisectStatus
    candidates: list[Change]
    tried: list[ProbeRecord]
    minimal: list[Change] | None
    tuner_policy: str
    state_path: str
    probes_run: int = 0
    notes: list[str] = _field(default_factory=list)

    def describe_criterion(self) -> str:
        return {
            Criterion.RANKS: f"rank {self.reference} (both re-run with the same toggles)",
            Criterion.EAGER: "its eager re-run (CUDA graph against eager, same toggles)",
            Criterion.LIVE: "every other rank (all re-run at once, live collectives)",
            Criterion.REPRODUCE: "the recording (its recorded outputs at this step)",
        }[Criterion(self.criterion)]

    def verdict(self) -> str:
        head = f"rank {self.rank}, step {self.step}: "
        cached = sum(1 for t in self.tried if t.cached)
        cost = f"{len(self.tried)} probes" + (f", {cached} answered from the saved state" if cached else "")
        if self.status == BisectStatus.NO_DIVERGENCE:
            return head + f"re-run with the recorded settings it already matches {self.describe_criterion()}: nothing to bisect"
        if self.status == BisectStatus.NO_FIX:
            return head + f"no combination of the {len(self.candidates)} toggles tried makes it match {self.describe_criterion()} ({cost})"
        if self.status == BisectStatus.INCOMPLETE:
            return head + f"stopped after {self.probes_run} new probes (--max-probes); run the same command again to resume"
        names = ", ".join(c.label for c in self.minimal or [])
        return head + f"the smallest set of toggles that makes it match {self.describe_criterion()}: {names} ({cost})"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": ResultKind.BISECT_CONFIG,
            "recording": self.recording,
            "part": self.part,
            "rank": self.rank,
            "step": self.step,
            "criterion": self.criterion,
            "reference": self.reference,
            "status": self.status,
            "candidates": [c.to_json() for c in self.candidates],
            "tried": [t.to_json() for t in self.tried],
            "minimal": [c.label for c in self.minimal] if self.minimal is not None else None,
            "minimal_toggles": [c.to_json() for c in self.minimal] if self.minimal is not None else None,
            "tuner_policy": self.tuner_policy,
            "probes_run": self.probes_run,
            "state": self.state_path,
            "notes": self.notes,
        }
