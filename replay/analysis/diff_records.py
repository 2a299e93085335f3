"""The records ``replay diff`` returns: options, verdicts, and the per-stream and per-run results.

Each prints (``to_json``) as the object ``replay diff --json`` shows; none holds a reference to a
recording, so a stream's result can come back from a worker process.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.analysis.align import BatchAlignment
from replay.analysis.diff_context import ContextDiff
from replay.errors import UsageError

__all__ = ["DiffOptions", "DiffVerdict", "FirstDifference", "StreamDiff", "UnshardedField", "RunDiff", "RecordingDiff", "StreamFacts", "worst"]


@dataclass(kw_only=True, slots=True)
class DiffOptions:
    rtol: float | None = None
    """Relative tolerance: fields whose bits differ but whose values are within it count as the same."""

    atol: float | None = None
    """Absolute tolerance. Given alone, ``rtol`` is 0 (and ``atol`` is 0 when ``rtol`` is given alone)."""

    ulp: int | None = None
    """Largest distance in units in the last place allowed between matching elements."""

    topk: int = 5
    """k of the top-k agreement reported for logits."""

    shards: dict[str, int] = field(default_factory=dict)
    """Declared shard dimensions (``{"output.hidden": 1}``) for plain-tensor TP whose recording has
    no layout: the field is split over the part's ranks, in rank order, along that dimension."""

    max_tensor_compares: int = 1000
    """Most tensors read per stream (tolerance) or steps per unsharded field; the rest are said to
    be not compared."""

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise UsageError(f"--{name} must be a finite number >= 0, not {v}")
        if self.ulp is not None and self.ulp < 0:
            raise UsageError(f"--ulp must be >= 0, not {self.ulp}")
        if self.topk < 1:
            raise UsageError(f"--topk must be >= 1, not {self.topk}")
        if self.max_tensor_compares < 1:
            raise UsageError("--max-tensor-compares must be >= 1")

    def tolerances(self) -> tuple[float | None, float | None]:
        """(rtol, atol) for ``compare_tensors``: one given alone sets the other to 0; neither given
        leaves its dtype defaults (used for the figures only, or under ``--ulp``)."""
        if self.rtol is None and self.atol is None:
            return None, None
        return (self.rtol or 0.0), (self.atol or 0.0)

    @property
    def tolerant(self) -> bool:
        return self.rtol is not None or self.atol is not None or self.ulp is not None

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n):g}" for n in ("rtol", "atol") if getattr(self, n) is not None]
        if self.ulp is not None:
            parts.append(f"ulp={self.ulp}")
        return ", ".join(parts) if parts else "bitwise"


class DiffVerdict(enum.Enum):
    SAME = "the same"
    WITHIN_TOLERANCE = "the same within tolerance"
    INCOMPLETE = "not shown to be the same"
    DIFFERENT = "different"

    def __str__(self) -> str:
        return self.value

    @property
    def exit_code(self) -> int:
        """As diff(1): 0 the same, 1 different (or not shown to be the same)."""
        return 0 if self in (DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE) else 1


_SEVERITY = [DiffVerdict.SAME, DiffVerdict.WITHIN_TOLERANCE, DiffVerdict.INCOMPLETE, DiffVerdict.DIFFERENT]


def worst(vs: list[DiffVerdict]) -> DiffVerdict:
    return max(vs, key=_SEVERITY.index) if vs else DiffVerdict.INCOMPLETE


@dataclass(slots=True)
class StreamFacts:
    """What the /steps tables of the two ranks say, apart from the fields."""

    steps_a: int
    steps_b: int
    common: np.ndarray  # steps both recorded
    only_a: np.ndarray
    only_b: np.ndarray
    raised_a: dict[int, str] = field(default_factory=dict)  # step -> error, capped
    raised_b: dict[int, str] = field(default_factory=dict)
    n_raised_a: int = 0
    n_raised_b: int = 0

    def to_json(self) -> dict[str, Any]:
        def steps(a: np.ndarray) -> dict[str, Any]:
            return {"count": int(a.size), "first": [int(s) for s in a[:10]]}

        return {"steps_a": self.steps_a, "steps_b": self.steps_b, "common_steps": int(self.common.size),
                "only_in_a": steps(self.only_a), "only_in_b": steps(self.only_b),
                "raised_in_a": {"count": self.n_raised_a, "first": {str(k): v for k, v in self.raised_a.items()}},
                "raised_in_b": {"count": self.n_raised_b, "first": {str(k): v for k, v in self.raised_b.items()}}}


@dataclass(slots=True)
class FirstDifference:
    step: int
    field: str
    digest_a: str | None  # None: not recorded on that side
    digest_b: str | None
    margin_a: float | None = None
    margin_b: float | None = None
    comparison: dict[str, Any] | None = None  # compare_tensors' verdict, when both tensors were kept
    note: str = ""
    # The model of the step, when a loop runs several (draft and target): its name and the
    # step's index among that model's steps in run A, as ``replay info`` numbers them.
    model: str | None = None
    model_step: int | None = None

    @property
    def where(self) -> str:
        """"step 9" or "step 9 (stream draft, its step 4)"."""
        return f"step {self.step}" + (f" (stream {self.model}, its step {self.model_step})" if self.model is not None else "")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "field": self.field, "digest_a": self.digest_a, "digest_b": self.digest_b,
                "margin_a": self.margin_a, "margin_b": self.margin_b, "comparison": self.comparison, "note": self.note,
                "model_stream": self.model, "model_stream_step": self.model_step}


@dataclass(slots=True)
class StreamDiff:
    """Rank ``rank_a`` of A against rank ``rank_b`` of B."""

    rank_a: int
    rank_b: int
    verdict: DiffVerdict
    facts: StreamFacts
    compared_rows: int
    differing_rows: int
    differing_steps: int
    first: FirstDifference | None
    first_token: FirstDifference | None
    first_beyond_tolerance: FirstDifference | None = None
    tolerance: dict[str, int] | None = None
    reasons: list[str] = field(default_factory=list)
    same_layout: bool = True  # both runs have as many ranks: rank r is named once
    by_field: dict[str, int] = field(default_factory=dict)  # field -> steps at which it differs (the most first)
    token_fields: bool = True  # a token field was recorded (else no token divergence can be claimed)
    # The first common step the two runs ran with different models (A's draft where B's target):
    # steps are paired by number, so from there one model's step is compared with the other's.
    models_apart: str = ""

    @property
    def name(self) -> str:
        if self.rank_a == self.rank_b and self.same_layout:
            return f"rank {self.rank_a}"
        return f"A rank {self.rank_a} / B rank {self.rank_b}"

    def to_json(self) -> dict[str, Any]:
        return {"stream": self.name, "rank_a": self.rank_a, "rank_b": self.rank_b, "verdict": str(self.verdict),
                **self.facts.to_json(), "compared_fields": self.compared_rows, "differing_fields": self.differing_rows,
                "differing_steps": self.differing_steps, "differing_by_field": self.by_field,
                "first_difference": self.first.to_json() if self.first else None,
                "first_token_divergence": self.first_token.to_json() if self.first_token else None,
                "first_beyond_tolerance": self.first_beyond_tolerance.to_json() if self.first_beyond_tolerance else None,
                "tolerance": self.tolerance, "reasons": self.reasons}


@dataclass(slots=True)
class UnshardedField:
    """A field laid out differently in A and B, compared whole."""

    field: str
    layout_a: str
    layout_b: str
    verdict: DiffVerdict
    compared_steps: int = 0
    differing_steps: int = 0
    first_step: int | None = None
    comparison: dict[str, Any] | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "layout_a": self.layout_a, "layout_b": self.layout_b, "verdict": str(self.verdict),
                "compared_steps": self.compared_steps, "differing_steps": self.differing_steps,
                "first_step": self.first_step, "comparison": self.comparison, "note": self.note}


@dataclass(slots=True)
class RunDiff:
    a: str
    b: str
    verdict: DiffVerdict
    headline: str
    tolerance: str
    layouts: dict[str, int]  # world sizes
    streams: list[StreamDiff]
    unsharded: list[UnshardedField]
    batching: BatchAlignment | None
    context: list[ContextDiff]
    notes: list[str]
    next: str = ""  # the command that finds the module making the first difference, when both runs can be re-run
    # The first difference is a collective's output, the same on every rank: the ranks whose
    # input to it differs between the runs (the ranks whose own computation changed).
    collective_inputs: list[int] | None = None
    # Every field agrees, but a collective's input differs between the runs (hidden by its
    # output): {"rank", "step", "field", "what"}.
    hidden_input: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @property
    def first(self) -> tuple[StreamDiff, FirstDifference] | None:
        """The earliest first difference over all streams (lowest step, then lowest rank)."""
        cands = [(s.first.step, s.rank_a, s) for s in self.streams if s.first is not None]
        if not cands:
            return None
        s = min(cands, key=lambda c: (c[0], c[1]))[2]
        return s, s.first  # type: ignore[return-value]

    @property
    def first_token(self) -> tuple[StreamDiff, FirstDifference] | None:
        cands = [(s.first_token.step, s.rank_a, s) for s in self.streams if s.first_token is not None]
        if not cands:
            return None
        s = min(cands, key=lambda c: (c[0], c[1]))[2]
        return s, s.first_token  # type: ignore[return-value]

    def to_json(self) -> dict[str, Any]:
        first, tok = self.first, self.first_token
        return {
            "verdict": str(self.verdict), "same": self.exit_code == 0, "headline": self.headline,
            "a": self.a, "b": self.b, "tolerance": self.tolerance, "world_size": self.layouts,
            "first_difference": ({"stream": first[0].name, **first[1].to_json()} if first else None),
            "first_token_divergence": ({"stream": tok[0].name, **tok[1].to_json()} if tok else None),
            "streams": [s.to_json() for s in self.streams],
            "unsharded": [u.to_json() for u in self.unsharded],
            "batching": self.batching.to_json() if self.batching else None,
            "other_differences": [c.to_json() for c in self.context],
            "notes": self.notes,
            "next": self.next or None,
            "first_collective_input_ranks": self.collective_inputs,
            "hidden_collective_input": self.hidden_input,
        }


@dataclass(slots=True)
class RecordingDiff:
    """Two recordings of several parts each, compared part by part (the parts both have)."""

    a: str
    b: str
    verdict: DiffVerdict
    headline: str
    parts: dict[str, RunDiff]
    only_a: list[str]
    only_b: list[str]

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_json(self) -> dict[str, Any]:
        return {"verdict": str(self.verdict), "same": self.exit_code == 0, "headline": self.headline,
                "a": self.a, "b": self.b, "parts_only_in_a": self.only_a, "parts_only_in_b": self.only_b,
                "parts": {name: d.to_json() for name, d in self.parts.items()}}
