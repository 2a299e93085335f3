"""Runs that batched differently: rows aligned by request and position, where the recording says.

Two runs of the same requests may batch them differently (another batch size, another order, a
request joining later). Step N of one is then not step N of the other, and a step-by-step diff
says everything differs. When both runs recorded, in full, an input naming each row's request
(``request_ids``, ...) and one giving its position (``input_pos``, ...), rows are matched by
(request, position) across all steps and their tokens (and outputs kept in full) compared row by row, bit for bit. When they did not, the
diff says that the rows cannot be aligned, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typing import TYPE_CHECKING

from replay._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

from replay.analysis.unshard import Missing, field_tensor
from replay.format.reader import RankFile
from replay.format.schema import TensorKind

__all__ = ["BatchAlignment", "REQUEST_INPUTS", "POSITION_INPUTS", "align_batches"]

REQUEST_INPUTS = ("request_ids", "request_id", "req_ids", "seq_ids")
POSITION_INPUTS = ("input_pos", "positions", "position_ids")
MAX_STEPS = 5000  # steps read per side; more are said to be left out


@dataclass(slots=True)
class BatchAlignment:
    """Whether the runs batched differently and, if so, what aligning rows found."""

    batched_differently: bool
    evidence: str = ""  # "input.input_ids has shape (4, 1) in A, (2, 1) in B at step 0"
    aligned: bool = False
    note: str = ""  # why rows cannot be aligned, or what was left out
    rows_compared: int = 0
    rows_differ: int = 0
    first: dict[str, Any] | None = None  # the first (request, position) whose tokens differ
    fields: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"batched_differently": self.batched_differently, "evidence": self.evidence, "aligned": self.aligned,
                "note": self.note, "rows_compared": self.rows_compared, "rows_differ": self.rows_differ,
                "first": self.first, "fields": self.fields}


def _input_shapes(rf: RankFile, step: int) -> dict[str, tuple[int, ...]]:
    t = rf.full()
    return {t.string(int(r["name"])): tuple(int(x) for x in r["shape"][: int(r["ndim"])])
            for r in rf.tensor_rows(step) if int(r["kind"]) == int(TensorKind.INPUT)}


def _pick(names: set[str], choices: tuple[str, ...]) -> str | None:
    """The input named one of ``choices``, at the top level or as the last part of a nested name
    (``batch.request_ids``: a field of a dict or data object the step takes)."""
    found = next((n for n in choices if n in names), None)
    if found is not None:
        return found
    return next((n for c in choices for n in sorted(names) if n.rpartition(".")[2] == c), None)


def _row_keys(rf: RankFile, step: int, req: str, pos: str) -> list[tuple[int, int]] | Missing:
    r = field_tensor(rf, step, f"input.{req}")
    p = field_tensor(rf, step, f"input.{pos}")
    if isinstance(r, Missing):
        return Missing(f"input.{req} {r}")
    if isinstance(p, Missing):
        return Missing(f"input.{pos} {p}")
    r = r.reshape(r.shape[0], -1)[:, 0] if r.dim() else r.reshape(1)
    # input_pos: [B] or [B, S]: a row's first position names it.
    p = p.reshape(p.shape[0], -1)[:, 0] if p.dim() else p.reshape(1)
    if r.shape[0] != p.shape[0]:
        return Missing(f"input.{req} has {r.shape[0]} rows and input.{pos} {p.shape[0]}")
    return list(zip(r.tolist(), p.tolist()))


def _token_rows(rf: RankFile, steps: np.ndarray, req: str, pos: str, digests_only: set[str]
                ) -> tuple[dict[tuple[int, int], dict[str, Any]], str]:
    """(request, position) -> {field: row bytes}, for every token and output field recorded in
    full with one row per request (compared bit for bit); ``digests_only`` gets the fields
    recorded as digests only (their rows cannot be compared)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    t = rf.full()
    for s in steps[:MAX_STEPS]:
        s = int(s)
        keys = _row_keys(rf, s, req, pos)
        if isinstance(keys, Missing):
            return out, f"step {s}: {keys}"
        rows = rf.tensor_rows(s)
        kinds = rows["kind"]
        for r in rows[(kinds == int(TensorKind.TOKENS)) | (kinds == int(TensorKind.OUTPUT))]:
            prefix = "tokens" if int(r["kind"]) == int(TensorKind.TOKENS) else "output"
            name = f"{prefix}.{t.string(int(r['name']))}"
            if int(r["offset"]) < 0:
                digests_only.add(name)
                continue
            v = rf.read_tensor(r)
            if v.dim() == 0 or v.shape[0] != len(keys):
                continue  # not one row per request: nothing to align
            for k, row in zip(keys, v):
                out.setdefault(k, {"step": s})[name] = row.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return out, ""


def align_batches(a: RankFile, b: RankFile, steps_a: np.ndarray, steps_b: np.ndarray, at: int | None = None) -> BatchAlignment:
    """Compare ``a`` and ``b`` by request and position when their batching differs (as their
    inputs' batch dimensions at step ``at`` show: by default the first common step; a batch that
    shrinks as requests end first differs later)."""
    common = np.intersect1d(steps_a, steps_b)
    if common.size == 0 or not steps_a.size or not steps_b.size:
        return BatchAlignment(batched_differently=False, note="no common step to compare batching at")
    s0 = at if at is not None and at in common else int(common[0])
    ia, ib = _input_shapes(a, s0), _input_shapes(b, s0)
    evidence = next((f"input.{name} has shape {ia[name]} in A and {ib[name]} in B at step {s0}"
                     for name in sorted(set(ia) & set(ib)) if ia[name][:1] != ib[name][:1]), "")
    if not evidence:
        return BatchAlignment(batched_differently=False)
    req = _pick(set(ia) & set(ib), REQUEST_INPUTS)
    pos = _pick(set(ia) & set(ib), POSITION_INPUTS)
    if req is None or pos is None:
        missing = " and ".join(w for w, n in (("request ids", req), ("positions", pos)) if n is None)
        return BatchAlignment(batched_differently=True, evidence=evidence,
                              note=f"rows cannot be aligned: the recordings have no {missing} among their inputs "
                                   f"(record an input named one of {', '.join(REQUEST_INPUTS if req is None else POSITION_INPUTS)}); "
                                   "the step-by-step comparison compares whole batches")
    digests_only: set[str] = set()
    rows_a, why_a = _token_rows(a, steps_a, req, pos, digests_only)
    rows_b, why_b = _token_rows(b, steps_b, req, pos, digests_only)
    if why_a or why_b:
        return BatchAlignment(batched_differently=True, evidence=evidence,
                              note=f"rows cannot be aligned: {'A ' + why_a if why_a else 'B ' + why_b}")
    left = [f"{w} has {n - MAX_STEPS} more steps, not read" for w, n in (("A", steps_a.size), ("B", steps_b.size)) if n > MAX_STEPS]
    return _aligned(evidence, rows_a, rows_b, digests_only, left)


def _aligned(evidence: str, rows_a: dict[tuple[int, int], dict[str, Any]], rows_b: dict[tuple[int, int], dict[str, Any]],
             digests_only: set[str], left: list[str]) -> BatchAlignment:
    """Rows of both runs compared by (request, position); or why none could be."""
    keys = sorted(set(rows_a) & set(rows_b), key=lambda k: (k[1], k[0]))
    differ, first, fields = _compare_rows(keys, rows_a, rows_b)
    only = len(set(rows_a) ^ set(rows_b))
    unseen = (f"{', '.join(sorted(digests_only))} recorded as digests only, whose rows cannot be compared "
              "(outputs = \"full\" in a record profile keeps them)") if digests_only else ""
    if not fields:
        why = ("no (request, position) row was recorded in both runs" if not keys
               else "no token or output field was recorded in full with one row per request")
        return BatchAlignment(batched_differently=True, evidence=evidence,
                              note=f"rows cannot be aligned: {why}" + (f"; {unseen}" if unseen else ""))
    notes = left + ([f"{only} (request, position) rows recorded in one run only"] if only else []) + ([unseen] if unseen else [])
    return BatchAlignment(batched_differently=True, evidence=evidence, aligned=True, note="; ".join(notes),
                          rows_compared=len(keys), rows_differ=differ, first=first, fields=sorted(fields))


def _compare_rows(keys: list[Any], rows_a: dict[Any, dict[str, Any]], rows_b: dict[Any, dict[str, Any]]
                  ) -> tuple[int, dict[str, Any] | None, set[str]]:
    """(rows that differ, the first of them, every field compared), over the (request, position) keys."""
    fields: set[str] = set()
    differ = 0
    first = None
    for k in keys:
        ra, rb = rows_a[k], rows_b[k]
        names = sorted((set(ra) & set(rb)) - {"step"})
        fields.update(names)
        bad = [n for n in names if ra[n] != rb[n]]
        if bad:
            differ += 1
            if first is None:
                first = {"request": k[0], "position": k[1], "field": bad[0], "step_a": ra["step"], "step_b": rb["step"]}
    return differ, first, fields
