"""Per-step curves of the report, binned: accepted tokens, how far ranks drift apart, logit margins."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import numpy as np

from replay.report.agreement import RankSteps

__all__ = ["accepted", "margin_histogram", "margins"]


def _per_step(per_rank: list[RankSteps], column: str, s: int, fill: float) -> np.ndarray:
    out = np.full((len(per_rank), s), fill, dtype=np.float64)
    for i, rs in enumerate(per_rank):
        out[i, rs.idx] = rs.rows[column]
    return out


def _bin_mean(a: np.ndarray, edges: np.ndarray) -> np.ndarray:
    known = ~np.isnan(a)
    sums = np.add.reduceat(np.where(known, a, 0.0), edges[:-1], axis=-1)
    counts = np.add.reduceat(known.astype(np.int64), edges[:-1], axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def accepted(per_rank: list[RankSteps], edges: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    s = int(edges[-1])
    if not s:
        return None, None
    acc = _per_step(per_rank, "accepted", s, -1.0)
    acc[acc < 0] = np.nan
    if np.isnan(acc).all():
        return None, None
    # Tokens ahead of (or behind) the median rank: how far the ranks' positions have drifted.
    cum = np.cumsum(np.nan_to_num(acc), axis=1)
    cum[np.isnan(acc)] = np.nan
    with np.errstate(all="ignore"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ahead = cum - np.nanmedian(cum, axis=0, keepdims=True)
    last = np.clip(edges[1:] - 1, 0, s - 1)
    return _bin_mean(acc, edges), ahead[:, last]


def margins(
    per_rank: list[RankSteps], steps: np.ndarray, edges: np.ndarray, tok: dict[str, Any] | None
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, dict[str, Any] | None]:
    s = int(edges[-1])
    if not s:
        return None, None, np.zeros(0), None
    m = _per_step(per_rank, "margin", s, np.nan)
    known = ~np.isnan(m)
    if not known.any():
        return None, None, np.zeros(0), None
    per_step = np.where(known.any(0), np.nanmin(np.where(known, m, np.inf), axis=0), np.nan)
    ok = ~np.isnan(per_step)
    big = np.where(ok, per_step, np.inf)
    mins = np.minimum.reduceat(big, edges[:-1])
    mins[np.isinf(mins)] = np.nan
    if int(np.max(np.diff(edges))) <= 1:
        med = per_step[edges[:-1]].copy()
    else:
        med = np.array([np.nanmedian(per_step[a:b]) if ok[a:b].any() else np.nan for a, b in itertools.pairwise(edges)])
    at = None
    if tok is not None:
        i = int(np.searchsorted(steps, tok["step"]))
        if i < s and steps[i] == tok["step"] and ok[i]:
            v = float(per_step[i])
            known_all = per_step[ok]
            at = {
                "step": int(tok["step"]),
                "margin": v,
                "per_rank": {str(rs.rank): (None if np.isnan(m[j, i]) else float(m[j, i])) for j, rs in enumerate(per_rank)},
                "percentile": float(100.0 * (known_all < v).mean()),  # share of steps with a smaller margin
            }
    return mins, med, per_step[ok], at


def margin_histogram(margins: np.ndarray, bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Counts over log-spaced edges; exact ties (margin 0) land in the first bin."""
    pos = margins[margins > 0]
    if not pos.size:
        return np.array([int(margins.size)]), np.array([0.0, 1.0])
    lo, hi = float(pos.min()), float(pos.max())
    if hi <= lo:
        hi = lo * 10
    edges = np.logspace(math.log10(lo) - 0.01, math.log10(hi) + 0.01, bins + 1)
    counts, _ = np.histogram(np.clip(margins, edges[0], None), bins=edges)
    return counts, edges
