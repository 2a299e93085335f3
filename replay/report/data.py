"""Everything the report shows, gathered from a recording's summary tables.

Only the per-step summary tables are read (``/steps``, ``/fields``, ``/graphs``, ``/kernels``,
``/tuner``), never tensor payloads, and the per-step work is vectorised, so 8 ranks x 100,000
steps take about a second. Steps are then grouped into at most ``max_bins`` equal bins: the page
(and ``--json``) shows one column per bin, the most severe thing that happened in it.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.summary import choose_part, summarize_part
from replay.errors import ReplayError
from replay.format.reader import Part, Recording
from replay.format.schema import RunMode, StepStatus
from replay.log import get_logger

__all__ = ["CELL_LABELS", "MAX_BINS", "Cell", "Report", "build_report", "load_results"]

log = get_logger(__name__)

MAX_BINS = 1000
"""Columns in the map, timeline and curves: more steps than this are binned."""

_MAX_RESULT_BYTES = 4 << 20
_MAX_RESULTS = 200


class Cell:
    """What one (rank, step) cell of the agreement map says, by increasing severity."""

    MISSING = -1  # the rank recorded no such step
    AGREE = 0
    GRAPH = 1  # ran another graph (or eager) than the majority, same numbers
    INPUT = 2  # inputs differ (usually fed back from an earlier divergence)
    COLLECTIVE = 3  # a collective's output differs
    OUTPUT = 4  # output bits differ, tokens agree
    TOKENS = 5  # sampled/accepted tokens differ
    RAISED = 6  # the step raised


CELL_LABELS: dict[int, str] = {
    Cell.MISSING: "not recorded",
    Cell.AGREE: "agrees",
    Cell.GRAPH: "other graph / eager",
    Cell.INPUT: "inputs differ",
    Cell.COLLECTIVE: "collective differs",
    Cell.OUTPUT: "output bits differ",
    Cell.TOKENS: "tokens differ",
    Cell.RAISED: "step raised",
}

# Field name prefix -> (category index, the cell code it gives when it differs).
_CATEGORIES: list[tuple[str, int]] = [
    ("graph", Cell.GRAPH),
    ("input.", Cell.INPUT),
    ("collective.", Cell.COLLECTIVE),
    ("output.", Cell.OUTPUT),
    ("", Cell.OUTPUT),  # anything else a newer recorder adds counts as an output
    ("tokens.", Cell.TOKENS),
]
_TOKENS = len(_CATEGORIES) - 1
_OTHER = len(_CATEGORIES) - 2

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads every input bit over the output (uint64, wraps)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _category(name: str) -> int:
    if name == "graph":
        return 0
    for i, (prefix, _) in enumerate(_CATEGORIES):
        if i != 0 and prefix and name.startswith(prefix):
            return i
    return _OTHER


@dataclass(slots=True)
class Report:
    """What the page shows. Arrays are ``[ranks, bins]``; ``bin_edges`` are step indices."""

    recording: str
    part: str
    parts: list[str]
    command: str | None
    summary: dict[str, Any]
    ranks: list[int]
    n_steps: int
    first_step: int
    last_step: int
    bin_edges: np.ndarray  # [B+1] positions into the sorted step list
    bin_steps: np.ndarray  # [B] first step of each bin
    cells: np.ndarray  # [R, B] int8, Cell codes (most severe in the bin)
    divergent_steps: np.ndarray  # steps where any rank differs from the majority (any field)
    token_divergent_steps: np.ndarray
    accepted: np.ndarray | None  # [R, B] float, mean accepted tokens per step, NaN unknown
    behind: np.ndarray | None  # [R, B] float, cumulative accepted minus the median rank
    margin_min: np.ndarray | None  # [B] smallest top-1/top-2 margin over ranks and steps
    margin_median: np.ndarray | None  # [B]
    margins: np.ndarray  # every known per-step margin (min over ranks), for the histogram
    margin_at: dict[str, Any] | None  # the margin at the first token divergence, and its rank
    graph_keys: list[dict[str, Any]]  # [{key, padded, steps}], index = timeline value
    timeline: np.ndarray  # [R, B] int16: index into graph_keys, -1 eager, -2 unknown, -3 none
    eager: np.ndarray  # [R, B] bool: some step in the bin ran eagerly
    rank_runs: list[dict[str, Any]]
    tuner_rows: list[dict[str, Any]]
    tuner_agreeing: int
    kernel_tables: list[dict[str, Any]]
    results: list[dict[str, Any]] = field(default_factory=list)
    skipped_results: list[str] = field(default_factory=list)
    diff: dict[str, Any] | None = None  # issue 17: `replay diff` against another run (--against), as its JSON

    @property
    def bin_size(self) -> int:
        return math.ceil(self.n_steps / max(1, self.cells.shape[1])) if self.n_steps else 1

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        return self.summary.get("first_divergence")

    @property
    def first_token_divergence(self) -> dict[str, Any] | None:
        return self.summary.get("first_token_divergence")

    def to_json(self) -> dict[str, Any]:
        def arr(a: np.ndarray | None, nd: int = 3) -> Any:
            if a is None:
                return None
            if a.dtype.kind != "f":
                return a.tolist()
            return [[None if math.isnan(v) else v for v in row] if isinstance(row, list) else (None if math.isnan(row) else row)
                    for row in np.round(a, nd).tolist()]

        hist_counts, hist_edges = margin_histogram(self.margins)
        return {
            "recording": self.recording,
            "part": self.part,
            "parts": self.parts,
            "command": self.command,
            **self.summary,
            "steps": {"count": self.n_steps, "first": self.first_step, "last": self.last_step},
            "bins": {"size": self.bin_size, "first_steps": self.bin_steps.tolist()},
            "agreement": {
                "legend": {str(k): v for k, v in CELL_LABELS.items()},
                "ranks": self.ranks,
                "cells": self.cells.tolist(),
                "divergent_steps": {"count": int(self.divergent_steps.size), "first": self.divergent_steps[:100].tolist()},
                "token_divergent_steps": {
                    "count": int(self.token_divergent_steps.size),
                    "first": self.token_divergent_steps[:100].tolist(),
                },
            },
            "accepted": None if self.accepted is None else {"mean_per_step": arr(self.accepted, 2), "ahead_of_median": arr(self.behind, 1)},
            "margins": {
                "min": arr(self.margin_min, 6),
                "median": arr(self.margin_median, 6),
                "at_first_token_divergence": self.margin_at,
                "histogram": {"edges": [float(e) for e in hist_edges], "counts": hist_counts.tolist()},
            },
            "timeline": {
                "graphs": self.graph_keys,
                "legend": {"-1": "eager", "-2": "unknown", "-3": "not recorded"},
                "cells": self.timeline.tolist(),
                "eager": self.eager.astype(int).tolist(),
                "per_rank": self.rank_runs,
            },
            "tuner": {"differing": self.tuner_rows, "agreeing_ops": self.tuner_agreeing},
            "kernels": self.kernel_tables,
            "results": self.results,
            "skipped_results": self.skipped_results,
            **({"diff": self.diff} if self.diff is not None else {}),  # issue 17
        }


# -- gathering ------------------------------------------------------------------------------


def build_report(recording: Recording | str | Path, part: str | None = None, *, max_bins: int = MAX_BINS) -> Report:
    """Gather the report of ``recording`` (a ``Recording`` or its path) for one part."""
    if not isinstance(recording, Recording):
        with Recording(recording) as rec:
            return build_report(rec, part, max_bins=max_bins)
    rec = recording
    chosen = choose_part(rec, part)
    summary = summarize_part(chosen)
    chosen = chosen.without(u["rank"] for u in summary["unreadable_ranks"])  # the summary names them
    cmd = rec.manifest.get("command")
    if isinstance(cmd, list):
        cmd = " ".join(map(str, cmd))
    ranks = list(chosen)
    steps, per_rank = _align(chosen)
    n = int(steps.size)
    b = max(1, min(n, max_bins))
    edges = np.linspace(0, n, b + 1).round().astype(np.int64)
    cells_full, div_steps, tok_steps = _agreement(per_rank, steps)
    cells = _bin_max(cells_full, edges)
    acc, behind = _accepted(per_rank, edges)
    mmin, mmed, margins, margin_at = _margins(per_rank, steps, edges, summary.get("first_token_divergence"))
    keys, timeline, eager, runs = _timeline(chosen, per_rank, edges)
    tuner_rows, tuner_agree = _tuner(chosen)
    results, skipped = load_results(rec.path)
    return Report(
        recording=str(rec.path),
        part=chosen.name,
        parts=list(rec),
        command=str(cmd) if cmd else None,
        summary=summary,
        ranks=ranks,
        n_steps=n,
        first_step=int(steps[0]) if n else 0,
        last_step=int(steps[-1]) if n else -1,
        bin_edges=edges,
        bin_steps=steps[edges[:-1]] if n else np.zeros(0, np.int64),
        cells=cells,
        divergent_steps=div_steps,
        token_divergent_steps=tok_steps,
        accepted=acc,
        behind=behind,
        margin_min=mmin,
        margin_median=mmed,
        margins=margins,
        margin_at=margin_at,
        graph_keys=keys,
        timeline=timeline,
        eager=eager,
        rank_runs=runs,
        tuner_rows=tuner_rows,
        tuner_agreeing=tuner_agree,
        kernel_tables=_kernels(summary.get("kernel_differences", [])),
        results=results,
        skipped_results=skipped,
    )


@dataclass(slots=True)
class _RankSteps:
    """One rank's steps laid on the common step axis (``idx``: positions in it)."""

    rank: int
    idx: np.ndarray
    rows: np.ndarray  # /steps rows, sorted by step
    cat: np.ndarray  # [C, S] uint64 combined digests per field category (0: absent)
    strings: Any


def _align(part: Part) -> tuple[np.ndarray, list[_RankSteps]]:
    tables = {r: part[r].tables for r in part}
    all_steps = [t.steps["step"] for t in tables.values() if t.steps.size]
    steps = _unique(np.concatenate(all_steps)) if all_steps else np.zeros(0, np.int64)
    names: dict[str, int] = {}
    out = []
    for r, t in tables.items():
        rows = np.sort(t.steps, order="step", kind="stable")
        idx = np.searchsorted(steps, rows["step"])
        out.append(_RankSteps(r, idx, rows, _field_digests(t, steps, names), t))
    return steps, out


def _unique(a: np.ndarray, *, inverse: bool = False) -> Any:
    """Sorted unique values (and the inverse map) by one sort: cheaper than np.unique's hashing here."""
    order = np.argsort(a, kind="stable")
    srt = a[order]
    first = np.ones(srt.size, dtype=bool)
    first[1:] = srt[1:] != srt[:-1]
    uniq = srt[first]
    if not inverse:
        return uniq
    inv = np.empty(a.size, dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    return uniq, inv


def _field_digests(t: Any, steps: np.ndarray, names: dict[str, int]) -> np.ndarray:
    """[C, S] per step and field category: an order-sensitive sum of mixed field digests."""
    c, s = len(_CATEGORIES), int(steps.size)
    f = t.fields
    out = np.zeros(c * s, dtype=np.uint64)
    if not f.size or not s:
        return out.reshape(c, s)
    ids = np.flatnonzero(np.bincount(np.clip(f["field"], 0, None)))
    gid = np.full(int(ids.max()) + 1, 0, dtype=np.uint64)
    cat = np.full(int(ids.max()) + 1, _OTHER, dtype=np.int64)
    for i in ids:
        name = t.string(int(i))
        gid[int(i)] = names.setdefault(name, len(names) + 1)
        cat[int(i)] = _category(name)
    fid = np.clip(f["field"], 0, None)
    pos = np.searchsorted(steps, f["step"])
    pos = np.clip(pos, 0, s - 1)
    with np.errstate(over="ignore"):
        key = gid[fid] * np.uint64(0x9E3779B97F4A7C15) + f["order"].astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)
        mixed = _mix(f["digest"] ^ _mix(key)) | np.uint64(1)  # never 0: 0 means "absent"
    np.add.at(out, cat[fid] * s + pos, mixed)
    return out.reshape(c, s)


def _vote(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Per column, the rank whose value the majority holds (ties: the group with the lowest rank)."""
    r, s = values.shape
    first = np.argmax(present, axis=0)
    ref = np.where(present.any(0), first, 0)
    if r < 2 or not s:
        return ref
    cols = np.flatnonzero(((values == values[ref, np.arange(s)]) | ~present).all(0) == False)
    for lo in range(0, cols.size, 4096):
        c = cols[lo : lo + 4096]
        v, p = values[:, c], present[:, c]
        # [R, R, n]: O(R^2) per disagreeing column only; agreeing columns were settled above.
        eq = (v[:, None, :] == v[None, :, :]) & p[:, None, :] & p[None, :, :]
        ref[c] = np.argmax(eq.sum(1), axis=0)  # argmax takes the lowest rank of the largest group
    return ref


def _agreement(per_rank: list[_RankSteps], steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([R, S] int8 cell codes, steps where any rank differs, steps where tokens differ)."""
    r, s = len(per_rank), int(steps.size)
    present = np.zeros((r, s), dtype=bool)
    raised = np.zeros((r, s), dtype=bool)
    for i, rs in enumerate(per_rank):
        present[i, rs.idx] = True
        raised[i, rs.idx] = rs.rows["status"] == StepStatus.RAISED
    cats = np.stack([rs.cat for rs in per_rank]) if per_rank else np.zeros((0, len(_CATEGORIES), s), np.uint64)
    cells = np.where(present, Cell.AGREE, Cell.MISSING).astype(np.int8)
    if not r or not s:
        return cells, np.zeros(0, np.int64), np.zeros(0, np.int64)
    cols = np.arange(s)
    # One vote on everything but tokens, then name the most severe category that differs from
    # the majority's; tokens get their own vote (what users compare first).
    body = [c for c in range(len(_CATEGORIES)) if c != _TOKENS]
    with np.errstate(over="ignore"):
        total = np.zeros((r, s), dtype=np.uint64)
        for c in body:
            total += _mix(cats[:, c, :] + np.uint64(c + 1))
    ref = _vote(total, present)
    differs = present & (total != total[ref, cols])
    for c in body:
        code = _CATEGORIES[c][1]
        d = differs & (cats[:, c, :] != cats[ref, c, cols])
        cells = np.where(d & (cells < code), code, cells).astype(np.int8)
    tok = cats[:, _TOKENS, :]
    tref = _vote(tok, present)
    tdiff = present & (tok != tok[tref, cols])
    cells[tdiff] = Cell.TOKENS
    cells[raised] = Cell.RAISED
    return cells, steps[(differs | tdiff).any(0)], steps[tdiff.any(0)]


def _bin_max(a: np.ndarray, edges: np.ndarray) -> np.ndarray:
    if a.shape[1] == 0:
        return a
    return np.maximum.reduceat(a, edges[:-1], axis=1)


def _per_step(per_rank: list[_RankSteps], column: str, s: int, fill: float) -> np.ndarray:
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


def _accepted(per_rank: list[_RankSteps], edges: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
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
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ahead = cum - np.nanmedian(cum, axis=0, keepdims=True)
    last = np.clip(edges[1:] - 1, 0, s - 1)
    return _bin_mean(acc, edges), ahead[:, last]


def _margins(
    per_rank: list[_RankSteps], steps: np.ndarray, edges: np.ndarray, tok: dict[str, Any] | None
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


def _timeline(
    part: Part, per_rank: list[_RankSteps], edges: np.ndarray
) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray, list[dict[str, Any]]]:
    s = int(edges[-1])
    r = len(per_rank)
    key_ids: dict[tuple[str, int], int] = {}
    counts: dict[int, int] = {}
    full = np.full((r, s), -3, dtype=np.int64)
    runs = []
    for i, rs in enumerate(per_rank):
        t = rs.strings
        rows = rs.rows
        mode = rows["mode"]
        vals = np.full(rows.size, -2, dtype=np.int64)
        vals[mode == RunMode.EAGER] = -1
        g = mode == RunMode.GRAPH
        if g.any():
            # One int64 per (graph key id, padded size): a 1-D unique is far cheaper than axis=0.
            pair = (rows["graph_key"][g].astype(np.int64) << 32) | (rows["padded_size"][g].astype(np.int64) & 0xFFFFFFFF)
            uniq, inv = _unique(pair, inverse=True)
            lut = np.array(
                [key_ids.setdefault((t.string(int(k) >> 32) or "?", _int32(int(k) & 0xFFFFFFFF)), len(key_ids)) for k in uniq]
            )
            vals[g] = lut[inv.reshape(-1)]
            for gi, c in enumerate(np.bincount(vals[g])):
                if c:
                    counts[int(gi)] = counts.get(int(gi), 0) + int(c)
        full[i, rs.idx] = vals
        eager_rows = rows[mode == RunMode.EAGER]
        reasons: dict[str, int] = {}
        for rid, c in enumerate(np.bincount(eager_rows["reason"].astype(np.int64) + 1)):
            if c:
                why = t.string(rid - 1) or "(no reason given)"
                reasons[why] = reasons.get(why, 0) + int(c)
        runs.append(
            {
                "rank": rs.rank,
                "graph_steps": int(g.sum()),
                "eager_steps": int(eager_rows.size),
                "graphs_captured": int(t.graphs.size),
                "eager_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
                "first_eager": [int(x) for x in eager_rows["step"][:8]],
            }
        )
    # Order keys by padded size so neighbouring buckets get neighbouring colours.
    order = sorted(key_ids.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    remap = np.arange(len(key_ids))
    keys = []
    for new, ((k, p), old) in enumerate(order):
        remap[old] = new
        keys.append({"key": k, "padded": p, "steps": counts.get(old, 0)})
    if len(key_ids):
        full = np.where(full >= 0, remap[np.clip(full, 0, None)], full)
    if not s:
        return keys, full.astype(np.int16), np.zeros((r, 0), bool), runs
    eager = np.maximum.reduceat((full == -1).astype(np.int8), edges[:-1], axis=1).astype(bool)
    if int(np.max(np.diff(edges))) <= 1:
        binned = full[:, edges[:-1]]
    else:
        binned = np.stack([_bin_mode(row, edges, len(keys)) for row in full]) if r else full[:, :0]
    return keys, binned.astype(np.int16), eager, runs


def _int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _bin_mode(row: np.ndarray, edges: np.ndarray, n_keys: int) -> np.ndarray:
    """The most frequent value in each bin (values -3..n_keys-1)."""
    b = edges.size - 1
    which = np.repeat(np.arange(b), np.diff(edges))
    width = n_keys + 3
    counts = np.bincount(which * width + (row + 3), minlength=b * width).reshape(b, width)
    return counts.argmax(1) - 3


def _tuner(part: Part) -> tuple[list[dict[str, Any]], int]:
    choices = {r: rf.tuner_choices() for r, rf in part.items()}
    ops = sorted({op for c in choices.values() for op in c})
    rows, agree = [], 0
    for op in ops:
        per = {r: c.get(op) for r, c in choices.items()}
        vals = [v for v in per.values()]
        if len(set(vals)) <= 1:
            agree += 1
            continue
        common = max(set(vals), key=lambda v: (vals.count(v), v is not None))
        rows.append({"op": op, "choices": {str(r): v for r, v in per.items()}, "majority": common})
    return rows, agree


def _kernels(diffs: list[dict[str, Any]], cap: int = 60) -> list[dict[str, Any]]:
    """Graph kernel lists side by side, aligned by launch order, rows where ranks differ."""
    tables = []
    for d in diffs:
        per: dict[str, list[str]] = d.get("kernels", {})
        ranks = sorted(per, key=lambda x: int(x) if str(x).isdigit() else 0)
        n = max((len(v) for v in per.values()), default=0)
        rows = []
        for i in range(n):
            cells = {r: (per[r][i] if i < len(per[r]) else None) for r in ranks}
            vals = list(cells.values())
            if len(set(vals)) > 1:
                common = max(set(vals), key=lambda v: (vals.count(v), v is not None))
                rows.append({"ordinal": i, "kernels": cells, "majority": common})
        tables.append(
            {
                "key": d.get("key", ""),
                "ranks": ranks,
                "n_kernels": {r: len(per[r]) for r in ranks},
                "rows": rows[:cap],
                "more_rows": max(0, len(rows) - cap),
                "only_on": d.get("only_on", {}),
            }
        )
    return tables


# -- saved results --------------------------------------------------------------------------


def load_results(recording: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``<recording>/results/*.json`` written by ``replay step`` and ``replay bisect``.

    Data only: parsed as JSON, never executed. Unreadable, oversized or non-object files are
    skipped and named in the second list.
    """
    folder = Path(recording) / "results"
    if folder.is_symlink():  # issue 16: never read (and embed in a shareable page) files from outside the recording
        return [], ["results: a symbolic link out of the recording, not read"]
    if not folder.is_dir():
        return [], []
    results, skipped = [], []
    for p in sorted(folder.glob("*.json"))[:_MAX_RESULTS]:
        if p.is_symlink():  # issue 16: as above
            skipped.append(f"{p.name}: a symbolic link, not read")
            continue
        try:
            if p.stat().st_size > _MAX_RESULT_BYTES:
                skipped.append(f"{p.name}: larger than {_MAX_RESULT_BYTES >> 20} MiB")
                continue
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append(f"{p.name}: not readable JSON ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})")
            continue
        if not isinstance(obj, dict):
            skipped.append(f"{p.name}: not a JSON object")
            continue
        if obj.get("kind") == "bisect-state" or p.name.startswith("bisect-state-"):
            continue  # an interrupted bisection's working state, not a result
        obj = dict(obj)
        obj["_file"] = p.name
        obj.setdefault("_mtime", p.stat().st_mtime)
        results.append(obj)
    results.sort(key=lambda o: o.get("_mtime", 0) if isinstance(o.get("_mtime"), (int, float)) else 0)
    return results, skipped


def check_report_path(out: Path) -> None:
    """Fail early, with one line, when the report cannot be written where asked."""
    parent = out.parent if str(out.parent) else Path(".")
    if out.exists() and out.is_dir():
        raise ReplayError(f"{out} is a directory: give a file name, e.g. -o {out / 'report.html'}")
    if not parent.is_dir():
        raise ReplayError(f"cannot write {out}: directory {parent} does not exist")
