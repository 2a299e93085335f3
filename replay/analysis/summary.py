"""What ``replay info`` reports: per-rank facts, the first divergence, and what differs around it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.analysis.divergence import (NO_OUTPUT_FIELDS, Divergence, computed_fields, field_names, first_divergence, has_fields,
                                        rank_only_fields)
from replay.errors import FormatVersionError, RecordingDamaged
from replay.format.reader import Part, RankFile, Recording
from replay.format.schema import RunMode, StepStatus

__all__ = ["RankSummary", "summarize_rank", "summarize_part", "choose_part", "part_divergence", "readable"]


@dataclass(slots=True)
class RankSummary:
    rank: int
    steps: int
    complete: bool
    live: bool
    sealed: bool
    host: str
    node_rank: int | None
    graphs_captured: int
    graph_steps: int
    eager_steps: int
    raised_steps: int
    last_error: str | None
    problem: str | None
    record_ring: dict[str, Any] | None = None  # issue 15: the record ring's size, policy, waits, drops
    stopped: str | None = None  # why the recorder switched itself off (its end marker says so)
    uncaught: str | None = None  # the error the rank's program ended on, uncaught

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def summarize_rank(rf: RankFile) -> RankSummary:
    t = rf.tables
    steps = t.steps
    raised = steps[steps["status"] == StepStatus.RAISED]
    last_error = t.string(int(raised["reason"][-1])) if raised.size else None
    problem = t.attrs.get("journal_problem")
    if problem:
        problem = f"journal ended early ({problem}; {t.attrs.get('lost_bytes', '?')} bytes of a partial frame dropped)"
    return RankSummary(
        rank=rf.rank,
        steps=int(steps.size),
        complete=rf.complete,
        live=rf.live,
        sealed=rf.sealed,
        host=str(t.attrs.get("host", "")),
        node_rank=t.attrs.get("node_rank"),
        graphs_captured=int(t.graphs.size),
        graph_steps=int((steps["mode"] == RunMode.GRAPH).sum()),
        eager_steps=int((steps["mode"] == RunMode.EAGER).sum()),
        raised_steps=int(raised.size),
        last_error=last_error,
        problem=problem,
        record_ring=_ring_stats(t.attrs.get("record_ring")),
        stopped=str(t.attrs["stopped"]) if t.attrs.get("stopped") else None,
        uncaught=str(t.attrs["uncaught"]) if t.attrs.get("uncaught") else None,
    )


def _ring_stats(v: Any) -> dict[str, Any] | None:
    """The record ring's figures from the end marker, kept only when they are well formed."""
    if not isinstance(v, dict) or not v.get("enabled"):
        return None
    keys = {"bytes": int, "policy": str, "full_waits": int, "full_wait_s": (int, float), "dropped_steps": int}
    if not all(isinstance(v.get(k), t) and not isinstance(v.get(k), bool) for k, t in keys.items()):
        return None
    return {k: v[k] for k in keys}


def part_divergence(part: Part) -> tuple[Divergence | None, Divergence | None]:
    """(first divergence of any field, first divergence of tokens)."""
    return first_divergence(part), first_divergence(part, prefix="tokens.")


def choose_part(rec: Recording, name: str | None) -> Part:
    """The part a command works on: ``name``, else the only one, else the first that diverged."""
    if name is not None:
        return rec[name]
    parts = list(rec.values())
    if len(parts) == 1:
        return parts[0]
    for p in parts:
        try:
            if first_divergence(readable(p)[0]) is not None:
                return p
        except RecordingDamaged:
            continue  # no rank of it can be read: it cannot be the one that diverged
    return parts[0]


def _margins(part: Part, step: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for r, rf in part.items():
        s = rf.tables.steps
        row = s[s["step"] == step]
        if row.size:
            m = float(row["margin"][0])
            out[str(r)] = None if math.isnan(m) else m
    return out


def _tuner_differences(part: Part) -> list[dict[str, Any]]:
    choices = {r: rf.tuner_choices() for r, rf in part.items()}
    ops = sorted({op for c in choices.values() for op in c})
    diffs = []
    for op in ops:
        per = {str(r): c.get(op) for r, c in choices.items()}
        if len(set(per.values())) > 1:
            diffs.append({"op": op, "choices": per})
    return diffs


def short_kernel_name(name: str) -> str:
    """``void at::native::reduce_kernel<128, 4, ...>(...)`` -> ``at::native::reduce_kernel``."""
    n = name.removeprefix("void ").strip()
    for stop in ("<", "("):
        i = n.find(stop)
        if i > 0:
            n = n[:i]
    return n


def _kernel_differences(part: Part) -> list[dict[str, Any]]:
    """Graphs captured for the same key whose kernel lists differ across ranks."""
    per_key: dict[str, dict[str, list[str]]] = {}
    for r, rf in part.items():
        t = rf.tables
        for g in t.graphs:
            key = t.string(int(g["key"]))
            ks = t.kernels[t.kernels["graph"] == g["graph"]]
            names = [short_kernel_name(t.string(int(k["name"]))) for k in np.sort(ks, order="ordinal")]
            per_key.setdefault(key, {})[str(r)] = names
    diffs = []
    for key, ranks in sorted(per_key.items()):
        seqs = {tuple(v) for v in ranks.values()}
        if len(seqs) > 1:
            common = set.intersection(*(set(v) for v in ranks.values()))
            first = next(i for i in range(max(map(len, ranks.values())) + 1)
                         if len({tuple(v[i:i + 1]) for v in ranks.values()}) > 1)
            diffs.append(
                {
                    "key": key,
                    "only_on": {r: sorted(set(v) - common) for r, v in ranks.items() if set(v) - common},
                    "first_difference": first,
                    "at_first_difference": {r: (v[first] if first < len(v) else None) for r, v in ranks.items()},
                    "counts": {r: len(v) for r, v in ranks.items()},
                    "kernels": ranks,
                }
            )
    return diffs


def readable(part: Part) -> tuple[Part, dict[int, str]]:
    """``part`` without the rank files that cannot be read, and why each cannot.

    One damaged file (cut short in transit, say) must not hide what the other ranks recorded;
    when none can be read, the first one's error is the answer."""
    bad: dict[int, RecordingDamaged] = {}
    for r, rf in part.items():
        try:
            rf.tables
        except FormatVersionError:
            raise  # written by a newer replay: the answer is to upgrade, not a partial view
        except RecordingDamaged as e:
            bad[r] = e
    if bad and len(bad) == len(part):
        raise next(iter(bad.values()))
    return (part.without(bad) if bad else part), {r: str(e) for r, e in bad.items()}


def _label_streams(part: Part, out: dict[str, Any]) -> None:
    """Several models in one loop (draft and target): the step sequence of each, its own first
    divergence across ranks, and the stream of each divergence found (issue 14)."""
    from replay.analysis.streams import step_streams

    out["streams"] = []
    if not len(part):
        return
    rf = part[min(part)]
    steps, idx, names = step_streams(rf)
    for i, name in enumerate(names):
        mine = steps[idx == i]
        d = first_divergence(part, steps=mine) if len(part) > 1 else None
        out["streams"].append({"stream": name, "steps": int(mine.size), "first_step": int(mine[0]),
                               "last_step": int(mine[-1]), "first_divergence": _in_stream(d.to_json(), steps, idx, names) if d else None})
    for key in ("first_divergence", "first_token_divergence"):
        if names and out.get(key):
            out[key] = _in_stream(out[key], steps, idx, names)


def _in_stream(d: dict[str, Any], steps: Any, idx: Any, names: list[str]) -> dict[str, Any]:
    """``d`` with the stream of its step and the step's index within that stream."""
    from replay.analysis.streams import stream_position

    at = stream_position(steps, idx, names, d["step"])
    return {**d, "stream": at[0], "stream_step": at[1]} if at is not None else d


# Notes the recorder keeps that say what was not recorded as it ran, shown by ``info``: what
# ``--check-lockstep`` found, steps two threads ran at once (one is recorded at a time), and a
# model whose parameters changed after its first recorded step (a re-run cannot rebuild that), and
# calls of an async step not recorded because another call of it was being awaited.
_SHOWN_EVENTS = ("lockstep:", "steps ran in two threads", "the model of stream ", "calls not recorded: ")


def lockstep_events(part: Part, limit: int = 5) -> list[str]:
    """What the recorder noted while recording that ``info`` shows (each rank notes it): once
    each, in order."""
    seen: list[str] = []
    for rf in part.values():
        for e in rf.tables.events:
            if e.startswith(_SHOWN_EVENTS) and e not in seen:
                seen.append(e)
    return seen[:limit]


def numerics_at_divergence(part: Part, div: Divergence) -> dict[str, Any] | None:
    """Where a rank that diverged ran a step under another numerics context than the majority
    (TF32, matmul precision, autocast, deterministic mode, ...) at or before the divergence: the
    first such step and what differs, the likeliest cause ``diff`` would name. None: no rank did
    (or no per-step context was recorded)."""
    from replay.analysis.diff_context import settings_at

    majority = next((r for r in div.majority if r in part), None)
    if majority is None:
        return None
    for rank in div.ranks:
        if rank not in part:
            continue
        changes = settings_at(part[majority], part[rank], div.step)
        if changes:
            return {"rank": rank, "majority_rank": majority, "step": div.step, "since": changes[0]["since"],
                    "changes": [{"name": c["name"], "majority": c["a"], "rank": c["b"], "since": c["since"]} for c in changes[:4]]}
    return None


# Attribute names that hold each rank's own number: they differ by design.
_OWN_NUMBER = ("rank", "local_rank", "world_size", "tp_rank", "pp_rank", "dp_rank")


def python_state_at_divergence(part: Part, div: Divergence) -> dict[str, Any] | None:
    """The Python attributes (the target's, its submodules': a flag the loop set on
    ``blocks[1]``) that a diverging rank's newest keyframe at or before the divergence holds
    otherwise than the majority's: what a config or weights comparison cannot show. A submodule's
    attribute is kept from its first change on: one rank's keyframe lacking it had not changed it.
    None: no keyframe, or no such attribute."""
    majority = next((r for r in div.majority if r in part), None)
    mine = part[majority].keyframe_python_state(div.step) if majority is not None else None
    for rank in div.ranks if mine is not None else []:
        theirs = part[rank].keyframe_python_state(div.step) if rank in part else None
        if theirs is None:
            continue
        changes = [{"name": n, "majority": mine[1].get(n), "rank": v} for n, v in theirs[1].items()
                   if mine[1].get(n) != v and n.rsplit(".", 1)[-1] not in _OWN_NUMBER]
        changes += [{"name": n, "majority": v, "rank": None} for n, v in mine[1].items()
                    if n not in theirs[1] and "." in n and n.rsplit(".", 1)[-1] not in _OWN_NUMBER]
        if changes:
            return {"rank": rank, "majority_rank": majority, "keyframe": theirs[0], "majority_keyframe": mine[0],
                    "changes": changes[:6]}
    return None


def arguments_at_divergence(part: Part, div: Divergence) -> dict[str, Any] | None:
    """The plain arguments (a temperature, a flag) a diverging rank's step took that differ
    from the majority's at the divergence, the one that began to differ last first. None: none."""
    from replay.analysis.diff_context import arguments_at

    majority = next((r for r in div.majority if r in part), None)
    for rank in div.ranks if majority is not None else []:
        if rank in part:
            # An argument holding each rank's own number (``rank``, ``local_rank``) differs by design.
            changes = [c for c in arguments_at(part[majority], part[rank], div.step)
                       if not (_is_int(c["a"]) and _is_int(c["b"]) and (c["a"], c["b"]) == (majority, rank))]
            if changes:
                return {"rank": rank, "majority_rank": majority, "step": div.step,
                        "changes": [{"name": c["name"], "majority": c["a"], "rank": c["b"], "since": c["since"]} for c in changes[:4]]}
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def offset_at_divergence(part: Part, div: Divergence) -> dict[str, Any] | None:
    """A diverging rank whose steps from the divergence on are the majority's shifted by a call
    or two (``replay.analysis.offset``): ``{"rank", "against", "shift", "from", "steps"}``."""
    from replay.analysis.offset import step_offset

    against = next((r for r in div.majority if r in part), None)
    for rank in div.ranks if against is not None else ():
        if rank in part:
            found = step_offset(part[against], part[rank], div.step)
            if found is not None:
                return {"rank": rank, "against": against, **found}
    return None


def summarize_part(part: Part, *, with_details: bool = True) -> dict[str, Any]:
    world = part.world_size
    part, unreadable = readable(part)
    ranks = [summarize_rank(rf) for rf in part.values()]
    div, tok = part_divergence(part)
    only = _rank_only(part)
    # Fields only some ranks record are not compared: the verdicts below speak of the others.
    names = field_names(part) - set(only) if div is None or tok is None else set()
    out: dict[str, Any] = {
        "part": part.name,
        "world_size": world,
        "ranks": [r.to_json() for r in ranks],
        "unreadable_ranks": [{"rank": r, "problem": why} for r, why in sorted(unreadable.items())],
        "missing_ranks": sorted(set(range(world)) - set(part) - set(unreadable)),
        "first_divergence": div.to_json() if div else None,
        "first_token_divergence": tok.to_json() if tok else None,
        # No token field recorded: "no token divergence" would be a claim nothing was compared for.
        "token_fields": tok is not None or has_fields(names, "tokens."),
        # Only inputs (and collectives) recorded: their agreement says nothing of what the steps
        # computed, and where they first differ may be after the steps' results first did.
        "output_fields": tok is not None or computed_fields(names),
    }
    out.update(_not_compared(part, div, only))
    if tok is not None:
        out["margin_at_token_divergence"] = _margins(part, tok.step)
    if div is not None:
        out["numerics_at_divergence"] = numerics_at_divergence(part, div)
        out["arguments_at_divergence"] = arguments_at_divergence(part, div)
        out["python_state_at_divergence"] = _python_state(part, div)
        out["offset_at_divergence"] = offset = offset_at_divergence(part, div)

        if offset and tok is not None and tok.step >= offset["from"] and set(tok.ranks) <= {offset["rank"]}:
            # Tokens compared as numbered across ranks offset by a call: the steps compared are
            # other steps, which have the same bits once shifted (tokens included).
            out["first_token_divergence"] = None
            out.pop("margin_at_token_divergence", None)
    _label_streams(part, out)
    out["step_callables"] = step_callables(part)
    out["unrecorded_calls"] = _unrecorded_calls(part)
    out["training_modes"] = training_modes(part)
    out["lockstep"] = lockstep_events(part)
    if with_details:
        out["unrecorded_fields"] = unrecorded_fields(part)
        out["tuner_differences"] = _tuner_differences(part)
        out["kernel_differences"] = _kernel_differences(part)
    return out


def training_modes(part: Part) -> dict[str, int] | None:
    """How many modules of each rank's model were in training mode at its first recorded step
    (``{rank: n}``), when the ranks differ in it (a rank left without ``.eval()`` runs dropout);
    None when they agree or it was not recorded."""
    counts: dict[str, int] = {}
    for r, rf in part.items():
        t = rf.attrs.get("target")
        n = t.get("training") if isinstance(t, dict) else None
        if isinstance(n, int) and not isinstance(n, bool):
            counts[str(r)] = n
    return counts if len(counts) > 1 and len(set(counts.values())) > 1 else None


def step_callables(part: Part) -> list[dict[str, Any]]:
    """What was recorded as the step, per model (stream): ``{"stream", "step", "kind"}`` as the
    lowest rank's target info names it (``generate:decode_one_token``, a function). Data from
    disk: only strings are kept."""
    if not len(part):
        return []
    t = part[min(part)].attrs.get("target")
    if not isinstance(t, dict):
        return []
    streams = t.get("streams") if isinstance(t.get("streams"), dict) and len(t["streams"]) > 1 else {None: t}
    out = []
    for name, info in streams.items():
        if isinstance(info, dict) and isinstance(info.get("step"), str) and info["step"]:
            kind = info.get("step_kind")
            out.append({"stream": name if isinstance(name, str) else None, "step": info["step"],
                        "kind": kind if isinstance(kind, str) else None})
    return out


def unrecorded_fields(part: Part) -> dict[str, str]:
    """What the steps gave the recorder that it could not record (a nested or sparse output),
    by field name, with its kind: no verdict compares them. Read from each distinct argument
    text of each rank's steps that names them (``UNRECORDED_ARG``)."""
    import json

    from replay.core.argnames import UNRECORDED_ARG

    found: dict[str, str] = {}
    for rf in part.values():
        t = rf.tables
        ids = t.steps["args"]
        for sid in np.unique(ids[ids >= 0]).tolist():
            text = t.string(int(sid))
            if UNRECORDED_ARG not in text:
                continue
            try:
                fields = json.loads(text).get(UNRECORDED_ARG)
            except (ValueError, AttributeError):
                continue
            if isinstance(fields, dict):
                found.update({k: v for k, v in fields.items() if isinstance(k, str) and isinstance(v, str)})
    return dict(sorted(found.items()))


_RANK_ONLY_SHOWN = 6


def _rank_only(part: Part) -> dict[str, list[int]]:
    """``rank_only_fields`` of a part, looked for only where the ranks' field names differ (one
    scan of each rank's field names tells; most recordings have none)."""
    if len(part) < 2:
        return {}
    per_rank = [field_names({r: rf}) for r, rf in part.items()]  # type: ignore[arg-type]
    if all(n == per_rank[0] for n in per_rank[1:]):
        return {}
    only = rank_only_fields(part)
    return dict(list(only.items())[:64])


def _python_state(part: Part, div: Divergence) -> dict[str, Any] | None:
    try:
        return python_state_at_divergence(part, div)
    except RecordingDamaged:
        return None  # a damaged keyframe: not compared (reading it says why)


def _unrecorded_calls(part: Part) -> dict[str, int]:
    """Per rank, the calls of the step made before its step 0 and not recorded (with no flags,
    discovery finds a module's step at its second call: the first, the prefill, runs unrecorded)."""
    out = {}
    for r, rf in part.items():
        t = rf.attrs.get("target")
        n = t.get("unrecorded_calls") if isinstance(t, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            out[str(r)] = n
    return out


def _not_compared(part: Part, div: Divergence | None, only: dict[str, list[int]]) -> dict[str, Any]:
    """What the verdict leaves out of the comparison across ranks: fields only some ranks record,
    and beside "no divergence", the collective inputs that are each rank's own (shards)."""
    out: dict[str, Any] = {"rank_only_fields": only} if only else {}
    if div is None and len(part) > 1:
        local = _rank_local_inputs(part)
        if local:
            out["rank_local_collective_inputs"] = local
    return out


def _rank_local_inputs(part: Part) -> list[str]:
    from replay.analysis.collective_inputs import rank_local_inputs

    try:
        return rank_local_inputs(part, list(part))
    except RecordingDamaged:
        return []  # a damaged rank's collectives: not compared (reading it says why)


def rank_local_note(summary: dict[str, Any]) -> str:
    """What "no divergence" leaves out of the collectives: the places whose inputs differ across
    the ranks from their first steps on (each rank's own shard, by design); "" when none."""
    local = summary.get("rank_local_collective_inputs") or []
    if not local:
        return ""
    return (f"; not compared: the inputs of {', '.join(local)}, which differ across the ranks from the first steps on "
            "(each rank's own shard, as a tensor-parallel partial sum is)")


def rank_only_note(summary: dict[str, Any]) -> str:
    """What was left out of the comparison across ranks: the fields only some ranks record from
    their first step on (ranks running different code, as pipeline stages do); "" when none."""
    only = summary.get("rank_only_fields") or {}
    if not only:
        return ""
    shown = ", ".join(f"{name} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} only)"
                      for name, rs in list(only.items())[:_RANK_ONLY_SHOWN])
    more = f" and {len(only) - _RANK_ONLY_SHOWN} more" if len(only) > _RANK_ONLY_SHOWN else ""
    return (f"not compared across ranks: {shown}{more}: only some ranks record them, from their first step on "
            f"(ranks running different code, as pipeline stages do)")


def verdict_line(summary: dict[str, Any]) -> str:
    """The one-line verdict of a part summary, the first line of ``replay info`` and ``replay
    report``: where the ranks first disagree (and their tokens), or that they never do, or that
    one rank has nothing to compare with. Never "no divergence" unless two ranks were compared."""
    d, t = summary.get("first_divergence"), summary.get("first_token_divergence")
    ranks = summary.get("ranks") or []
    left_out = " (among the ranks that can be read)" if summary.get("unreadable_ranks") else ""
    if d is None:
        if len(ranks) < 2:
            return f"one rank{left_out}: nothing to compare across ranks"
        if any(not int(r.get("steps") or 0) for r in ranks):
            # A rank with no step shares none with the others: nothing was compared.
            return f"nothing compared{left_out}: a rank recorded no step, so the ranks share no step to compare"
        only = rank_only_note(summary)
        if summary.get("output_fields") is False:
            if only:
                return (f"nothing compared{left_out}: no output or token field is recorded by every rank, and what they "
                        f"all record went into the steps (it agrees); {only}")
            return f"nothing compared{left_out}: {NO_OUTPUT_FIELDS}"
        return (f"no divergence{left_out}: {len(ranks)} ranks recorded the same bits at every common step"
                + (" in the fields they all record" if only else "") + step_count_note(ranks) + (f"; {only}" if only else "")
                + rank_local_note(summary))
    text = f"first divergence at {_at(d)}{left_out}: {divergence_what(d)}"
    offset = summary.get("offset_at_divergence")
    if offset:
        from replay.analysis.offset import offset_brief

        text += f"; but {offset_brief(offset)}"
    if summary.get("output_fields") is False:
        # Inputs alone: a step that computed otherwise shows only in a later step's input.
        return text + "; no step output recorded, so what the steps computed may have differed earlier"
    if t is not None:
        return text + f"; first token divergence at {_at(t)} ({t['field']})"
    if summary.get("token_fields") is False:
        return text + "; no token field recorded to compare"
    return text + ("; no token divergence once the offset is taken into account" if offset else "; no token divergence")


def step_count_note(ranks: list[dict[str, Any]]) -> str:
    """Said beside "no divergence" when the ranks recorded different numbers of steps: the steps
    past a rank's last were compared among fewer ranks, or not at all."""
    counts = {int(r["rank"]): int(r.get("steps") or 0) for r in ranks}
    if len(set(counts.values())) < 2:
        return ""
    shown = ", ".join(f"rank {r} {n}" for r, n in sorted(counts.items())[:8])
    return (f"; but the ranks recorded different numbers of steps ({shown}{', ...' if len(counts) > 8 else ''}): a rank "
            "that stopped early was not compared past its last step")


def divergence_what(d: dict[str, Any]) -> str:
    """What differs at a divergence (``Divergence.what``), from its JSON."""
    what = d.get("what")
    if isinstance(what, str):
        return what
    return f"{d['field']} differs on rank(s) {', '.join(map(str, d['ranks']))} (majority: {', '.join(map(str, d.get('majority') or []))})"


def _at(d: dict[str, Any]) -> str:
    """``step 9`` or ``step 9 (stream draft, its step 3)``."""
    if d.get("stream") is None:
        return f"step {d['step']}"
    return f"step {d['step']} (stream {d['stream']}, its step {d.get('stream_step', '?')})"
