"""Which graph (or eager) each rank ran, per bin; and the tuner choices and graph kernels that differ."""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.format.reader import Part
from replay.format.schema import RunMode
from replay.report.agreement import RankSteps, unique

__all__ = ["kernels", "timeline", "tuner"]


def timeline(
    part: Part, per_rank: list[RankSteps], edges: np.ndarray
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
            uniq, inv = unique(pair, inverse=True)
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


def tuner(part: Part) -> tuple[list[dict[str, Any]], int]:
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


def kernels(diffs: list[dict[str, Any]], cap: int = 60) -> list[dict[str, Any]]:
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
