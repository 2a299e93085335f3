"""Everything the report shows, gathered from a recording's summary tables.

Only the per-step summary tables are read (``/steps``, ``/fields``, ``/graphs``, ``/kernels``,
``/tuner``), never tensor payloads, and the per-step work is vectorised, so 8 ranks x 100,000
steps take about a second. Steps are then grouped into at most ``max_bins`` equal bins: the page
(and ``--json``) shows one column per bin, the most severe thing that happened in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.summary import choose_part, summarize_part
from replay.errors import ReplayError
from replay.format.reader import Recording
from replay.log import get_logger
from replay.report.agreement import CELL_LABELS, Cell, agreement, align, bin_max
from replay.report.curves import accepted, margin_histogram, margins
from replay.report.results import load_results
from replay.report.timeline import kernels, timeline, tuner

__all__ = ["CELL_LABELS", "MAX_BINS", "Cell", "Report", "build_report", "check_report_path", "load_results", "margin_histogram"]

log = get_logger(__name__)

MAX_BINS = 1000
"""Columns in the map, timeline and curves: more steps than this are binned."""


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
    has_factory: bool = False  # a rank's target names a factory (bisect layers needs one)

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
    steps, per_rank = align(chosen)
    n = int(steps.size)
    b = max(1, min(n, max_bins))
    edges = np.linspace(0, n, b + 1).round().astype(np.int64)
    cells_full, div_steps, tok_steps = agreement(per_rank, steps)
    cells = bin_max(cells_full, edges)
    acc, behind = accepted(per_rank, edges)
    mmin, mmed, known_margins, margin_at = margins(per_rank, steps, edges, summary.get("first_token_divergence"))
    keys, graph_cells, eager, runs = timeline(chosen, per_rank, edges)
    tuner_rows, tuner_agree = tuner(chosen)
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
        margins=known_margins,
        margin_at=margin_at,
        graph_keys=keys,
        timeline=graph_cells,
        eager=eager,
        rank_runs=runs,
        tuner_rows=tuner_rows,
        tuner_agreeing=tuner_agree,
        kernel_tables=kernels(summary.get("kernel_differences", [])),
        results=results,
        skipped_results=skipped,
        has_factory=any(_names_factory(rf.attrs.get("target")) for rf in chosen.values()),
    )


def _names_factory(target: Any) -> bool:
    return isinstance(target, dict) and isinstance(target.get("factory"), str) and bool(target["factory"])


def check_report_path(out: Path) -> None:
    """Fail early, with one line, when the report cannot be written where asked."""
    parent = out.parent if str(out.parent) else Path(".")
    if out.exists() and out.is_dir():
        raise ReplayError(f"{out} is a directory: give a file name, e.g. -o {out / 'report.html'}")
    if not parent.is_dir():
        raise ReplayError(f"cannot write {out}: directory {parent} does not exist")
