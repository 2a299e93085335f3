"""Ranks whose steps are the same steps offset by a call or two: not a divergence.

A rank that made one call of the step more than the others before the recording's step 0 (a
warm-up or health check on one rank), or raised in a step and called it again, records the same
sequence of steps under other numbers: every step from there on differs by number, and the first
divergence is found at the first offset step. Each step's field digests, combined, make one
signature per step; a rank whose signatures from the divergence on equal another's shifted by a
few steps is offset, not diverged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.format.reader import RankFile

__all__ = ["offset_brief", "offset_text", "step_offset"]

# Shifts tried, and the fewest steps that must agree after the shift to call it an offset.
_SHIFTS = (1, -1, 2, -2)
_MIN_AGREE = 2
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _signatures(rf: RankFile, names: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, one signature per step) from the rank's field rows: every field's name and digest."""
    t = rf.tables
    f = t.fields
    if not f.size:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    lut = np.zeros(len(t.strings) + 1, dtype=np.uint64)
    for i in np.unique(f["field"]):
        lut[int(i)] = np.uint64(names.setdefault(t.string(int(i)), len(names)) + 1)
    order = np.argsort(f["step"], kind="stable")
    steps = f["step"][order].astype(np.int64)
    with np.errstate(over="ignore"):
        mixed = f["digest"][order].astype(np.uint64) ^ (lut[f["field"][order]] * _MIX)
    starts = np.flatnonzero(np.concatenate(([True], steps[1:] != steps[:-1])))
    # A sum of per-field mixes, so that the fields' order within a step does not matter.
    with np.errstate(over="ignore"):
        sig = np.add.reduceat(mixed, starts)
    return steps[starts], sig


def step_offset(a: RankFile, b: RankFile, start: int) -> dict[str, Any] | None:
    """Whether ``b``'s steps from ``start`` on are ``a``'s shifted by a few steps: ``{"shift": k,
    "from": s0, "steps": n}`` (``b``'s step ``s`` equals ``a``'s step ``s + k`` for the ``n``
    steps both have from ``s0``, which is ``start``, or the step after it when ``b``'s step
    ``start`` has no counterpart: a step it raised in and called again), or None."""
    names: dict[str, int] = {}
    sa, ga = _signatures(a, names)
    sb, gb = _signatures(b, names)
    sig_a = dict(zip(sa.tolist(), ga.tolist()))
    for first in (start, start + 1):
        later = sb >= first
        same_index = [(sig_a[s], g) for s, g in zip(sb[later].tolist(), gb[later].tolist()) if s in sig_a]
        if same_index and all(x == y for x, y in same_index):
            # The steps agree as numbered too (a one-step difference, then the same steps): a
            # shift that also agrees only says the steps repeat (greedy decoding in a loop).
            continue
        for k in _SHIFTS:
            pairs = [(sig_a[s + k], g) for s, g in zip(sb[later].tolist(), gb[later].tolist()) if s + k in sig_a]
            if len(pairs) >= _MIN_AGREE and all(x == y for x, y in pairs):
                return {"shift": k, "from": first, "steps": len(pairs)}
    return None


def _calls(o: dict[str, Any]) -> str:
    k = abs(int(o["shift"]))
    return f"{k} call{'s' if k > 1 else ''}"


def offset_brief(o: dict[str, Any]) -> str:
    """``step_offset``'s finding in a clause of a verdict line."""
    return (f"rank {o['rank']}'s steps from there are rank {o['against']}'s offset by {_calls(o)} of the step, with the "
            "same bits (not a divergence from there)")


def offset_text(o: dict[str, Any]) -> str:
    """``step_offset``'s finding for ``info``, ranks named (keys ``rank``, ``against``)."""
    k = int(o["shift"])
    return (f"rank {o['rank']}'s steps from step {o['from']} are rank {o['against']}'s from step {o['from'] + k} "
            f"({o['steps']} steps with the same bits once shifted): the ranks are offset by {_calls(o)} of the step "
            f"(one made calls the other did not: a warm-up, a step retried after an error), not diverged from there; "
            f"compare rank {o['rank']}'s step N with rank {o['against']}'s step N{k:+d}")
