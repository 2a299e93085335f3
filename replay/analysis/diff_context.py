"""What else differs between two runs, beside the steps: ranked by how likely it is the cause.

The order is the order in which a difference changes what the same code computes: weights change
the function itself; the target's config changes the model or the engine; the numerics context
(TF32, deterministic mode, SDPA backend, the numerics env vars) changes how the same kernels
compute; tuner choices and the kernels captured inside graphs change which kernels run; versions
change everything a little and are often the same on both sides; the environment (hosts, command)
rarely matters by itself. Only metadata is read: rank file attributes and the small tables.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from replay.analysis.summary import short_kernel_name
from replay.analysis.unshard import param_global_shape
from replay.core.environment import recorded_env_differences
from replay.errors import RecordingDamaged
from replay.format.reader import RankFile

__all__ = ["Category", "ContextDiff", "RankMeta", "rank_meta", "context_differences", "first_numerics_difference",
           "arguments_difference"]

NUMERICS_ARG = "__numerics__"  # the step argument holding the digest of the step's numerics context


@dataclass(slots=True)
class RankMeta:
    """What the comparison of settings needs from one rank file: small, and cheap to pass between
    processes (the streams of a large diff are compared in worker processes)."""

    rank: int
    attrs: dict[str, Any]
    tuner: dict[str, str]
    kernels: dict[str, list[str]]
    # The target object's Python scalars at the first keyframe (a temperature, a scale, a flag
    # kept as an attribute of the model and read inside forward): (step, {name: value}).
    scalars: tuple[int, dict[str, Any]] | None = None
    # The step's arguments recorded by class name only ("draft (a LM)"): a second model the step
    # takes has no weights recorded, and "weights the same" must not speak for it.
    unrecorded: list[str] = field(default_factory=list)


def rank_meta(rf: RankFile) -> RankMeta:
    try:
        scalars = rf.first_keyframe_scalars()
    except (RecordingDamaged, KeyError, ValueError, TypeError):
        scalars = None  # a damaged keyframe table: the scalars are not compared (reading the steps says why)
    return RankMeta(rank=rf.rank, attrs=dict(rf.attrs), tuner=rf.tuner_choices(), kernels=_graph_kernels(rf), scalars=scalars,
                    unrecorded=_unrecorded_arguments(rf))


_MAX_ARG_TEXTS = 256  # distinct argument texts read for the arguments recorded by class name only


def _unrecorded_arguments(rf: RankFile) -> list[str]:
    """The step arguments recorded by class name only, from each distinct argument text."""
    from replay.textsafe import a_or_an

    found: dict[str, str] = {}
    try:
        ids = rf.tables.steps["args"]
        for sid in np.unique(ids[ids >= 0])[:_MAX_ARG_TEXTS].tolist():
            args = json.loads(rf.tables.string(int(sid)))
            for name, v in (args.items() if isinstance(args, dict) else ()):
                if isinstance(v, dict) and isinstance(v.get("unrecorded"), str):
                    found.setdefault(str(name), f"{name} ({a_or_an(v['unrecorded'])})")
    except (RecordingDamaged, KeyError, ValueError, TypeError):
        return []
    return sorted(found.values())

_CAP = 20  # items listed per category; the count says how many there are


class Category(enum.Enum):
    WEIGHTS = "weights"
    BUFFERS = "buffers"
    CONFIG = "config"
    ARGUMENTS = "step arguments"
    NUMERICS = "numerics"
    TUNER = "tuner choices"
    KERNELS = "graph kernels"
    VERSIONS = "versions"
    ENVIRONMENT = "environment"


RANKED = list(Category)


@dataclass(slots=True)
class ContextDiff:
    """One category: what differs (capped), or why it could not be compared."""

    category: Category
    items: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0
    note: str = ""  # "weights not recorded", "different layouts: ...", ...
    compared: bool = True

    @property
    def differs(self) -> bool:
        return self.count > 0

    def to_json(self) -> dict[str, Any]:
        return {"category": self.category.value, "differs": self.differs, "count": self.count,
                "compared": self.compared, "note": self.note, "items": self.items}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def _dict_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    fa, fb = _flatten(a), _flatten(b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        va, vb = fa.get(k, "<unset>"), fb.get(k, "<unset>")
        if json.dumps(va, sort_keys=True, default=str) != json.dumps(vb, sort_keys=True, default=str):
            out.append({"name": k, "a": _short(va), "b": _short(vb)})
    return out


def _short(v: Any) -> Any:
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= 120 else s[:117] + "..."


def _target(rf: RankMeta) -> dict[str, Any]:
    t = rf.attrs.get("target")
    return t if isinstance(t, dict) else {}


def _models(m: RankMeta) -> dict[str | None, dict[str, Any]]:
    """The target info of each model of a loop that runs several (draft and target), by stream
    name, each with the part's entries under its own; {None: the target info} for one model.
    The part's top-level entries are its first model's only: compared alone, a second model's
    weights or compile settings would go unseen."""
    t = _target(m)
    streams = t.get("streams")
    if not isinstance(streams, dict) or len(streams) < 2:
        return {None: t}
    return {str(k): {**t, **v} for k, v in streams.items() if isinstance(v, dict)}


def _by_model(pairs: list[tuple[RankMeta, RankMeta]]) -> list[tuple[str | None, list[tuple[dict[str, Any], dict[str, Any]]]]]:
    """(model name, [(A's target info of it, B's), per rank pair]) for each model both runs
    have; a model only one run has is (name, []) so the caller can say so."""
    names: list[str | None] = []
    for a, b in pairs:
        for n in [*_models(a), *_models(b)]:
            if n not in names:
                names.append(n)
    out = []
    for n in names:
        both = [(_models(a).get(n), _models(b).get(n)) for a, b in pairs]
        out.append((n, [(x, y) for x, y in both if x is not None and y is not None]))
    return out


def _of_model(name: str, model: str | None) -> str:
    return name if model is None else f"{name} (stream {model})"


def _capped(cat: Category, items: list[dict[str, Any]], note: str = "") -> ContextDiff:
    return ContextDiff(category=cat, items=items[:_CAP], count=len(items), note=note)


def _whole(cat: Category, items: list[dict[str, Any]], note: str = "") -> ContextDiff:
    """Every item of one rank pair, uncapped: ``_over_pairs`` merges the pairs, then caps."""
    return ContextDiff(category=cat, items=items, count=len(items), note=note)


def _over_pairs(pairs: list[tuple[RankMeta, RankMeta]], compare: Callable[[RankMeta, RankMeta], ContextDiff]) -> ContextDiff:
    """One category compared on every rank pair: a setting left unsynchronised on one rank is
    the case this tool is for, and the first pair alone would call it the same. An item that
    differs alike on every pair is listed once, as with one rank; one that differs on some
    pairs only is named with them (``ranks_a``, or ``rank_a``/``rank_b`` for pairs of other ranks)."""
    diffs = [compare(a, b) for a, b in pairs]
    done = [(a.rank, b.rank, d) for (a, b), d in zip(pairs, diffs) if d.compared]
    if not done:
        return diffs[0]
    items = [x for it, on in _pairs_of_items(done) for x in _on_ranks(it, on, len(pairs))]
    # The note of the first pair where something differs (where the per-step contexts first differ).
    note = next((d.note for *_, d in done if d.items and d.note), done[0][2].note)
    skipped = [(a.rank, d.note) for (a, _), d in zip(pairs, diffs) if not d.compared]
    if skipped:
        note += ("; " if note else "") + f"not compared on rank(s) {', '.join(str(r) for r, _ in skipped)}: {skipped[0][1]}"
    return _capped(done[0][2].category, items, note)


def _pairs_of_items(done: list[tuple[int, int, ContextDiff]]) -> list[tuple[dict[str, Any], list[tuple[int, int]]]]:
    """Each item that differs, in the order first seen, with the rank pairs it differs on."""
    where: dict[tuple[str, int], tuple[dict[str, Any], list[tuple[int, int]]]] = {}
    for ra, rb, d in done:
        seen: dict[str, int] = {}  # an item twice in one pair stays twice
        for it in d.items:
            key = json.dumps(it, sort_keys=True, default=str)
            seen[key] = seen.get(key, 0) + 1
            where.setdefault((key, seen[key]), (it, []))[1].append((ra, rb))
    return list(where.values())


def _on_ranks(item: dict[str, Any], on: list[tuple[int, int]], n_pairs: int) -> list[dict[str, Any]]:
    """``item`` as it differs on the rank pairs ``on``: as it is when on every pair, else named
    with the ranks (the weights' ``ranks_a`` when each pair is of one rank, else one item per pair)."""
    if len(on) == n_pairs:
        return [item]
    if all(ra == rb for ra, rb in on):
        return [{**item, "ranks_a": [ra for ra, _ in on]}]
    return [{**item, "rank_a": ra, "rank_b": rb} for ra, rb in on]


def _weights(pairs: list[tuple[RankMeta, RankMeta]], same_layout: bool) -> ContextDiff:
    merged: list[dict[str, Any]] = []
    replicated = 0  # parameters replicated in both runs (across layouts: compared by digest)
    for model, infos in _by_model(pairs):
        if not infos:  # a model one run has and the other has not: nothing to compare it with
            side = "A" if any(model in _models(a) for a, _ in pairs) else "B"
            return ContextDiff(category=Category.WEIGHTS, compared=False, note=f"stream {model} recorded in run {side} only")
        wa = [ta.get("weights") for ta, _ in infos]
        wb = [tb.get("weights") for _, tb in infos]
        missing = _weights_missing(wa, wb)
        if missing:
            return ContextDiff(category=Category.WEIGHTS, compared=False,
                               note=f"weights not recorded in {missing}" + (f" for stream {model}" if model else ""))
        items = _digest_items(pairs, wa, wb)
        if not same_layout:
            found, equal = _replicated_items(pairs, wa, wb)
            items = found + items
            replicated += len(found) + equal
        merged += [{**it, "name": _of_model(it["name"], model)} for it in items]
    if same_layout:
        # Digested once, as each run's first recorded step found them: a weight the program
        # changed later (an adapter added mid-run) is not seen here.
        return _capped(Category.WEIGHTS, merged, "as at each run's first recorded step" + _objects_not_weighed(pairs))
    if not merged:
        # Digests of shards cannot be compared across layouts: do not call the weights the same.
        same = f"; the {replicated} replicated in both runs have the same digests" if replicated else ""
        return ContextDiff(category=Category.WEIGHTS, compared=False,
                           note=f"names, shapes and dtypes the same{same}; digests of the others are per shard, so their values "
                                "cannot be compared across layouts")
    return _capped(Category.WEIGHTS, merged, "the runs are laid out differently: parameters replicated in both runs (one "
                   "digest on every rank of each) compared by digest, the others by names, shapes and dtypes only")


def _objects_not_weighed(pairs: list[tuple[RankMeta, RankMeta]]) -> str:
    """The objects the step takes that were recorded by class name only (a draft model passed
    beside the target): the weights compared are the step's model's, not theirs."""
    names = sorted({u for a, b in pairs for u in (*a.unrecorded, *b.unrecorded)})
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (f"; the step's model only: it also takes {shown}, recorded by class name only, whose weights (if any) "
            "were not recorded or compared")


def _weights_missing(wa: list[Any], wb: list[Any]) -> str:
    """Which run recorded no weights ("" when both did)."""
    have_a = all(isinstance(w, dict) and w for w in wa)
    have_b = all(isinstance(w, dict) and w for w in wb)
    if have_a and have_b:
        return ""
    return "either run" if not have_a and not have_b else ("run A" if not have_a else "run B")


def _replicated_items(pairs: list[tuple[RankMeta, RankMeta]], da: list[dict[str, Any]],
                      db: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Across layouts: a parameter of one dtype, shape and digest on every rank of A, and of
    that dtype and shape and one digest on every rank of B, is replicated in both runs, so its
    digests compare (a shard's digest differs from rank to rank). The ones that differ, and how
    many were found equal."""
    of_a = {ra.rank: w for (ra, _), w in zip(pairs, da)}
    of_b = {rb.rank: w for (_, rb), w in zip(pairs, db)}
    items, equal = [], 0
    for name in sorted(set.intersection(*(set(w) for w in [*of_a.values(), *of_b.values()]))):
        va, vb = _one_value(of_a.values(), name), _one_value(of_b.values(), name)
        if va is None or vb is None or va[:2] != vb[:2]:
            continue
        if va[2] == vb[2]:
            equal += 1
            continue
        items.append({"name": name, "a": _short(va[2]), "b": _short(vb[2]), "ranks_a": sorted(of_a),
                      "why": "digest (replicated: one digest on every rank of each run)"})
    return items, equal


def _one_value(weights: Any, name: str) -> tuple[Any, Any, Any] | None:
    """(dtype, shape, digest) of ``name`` when every rank's is the same; None otherwise."""
    seen = set()
    for w in weights:
        p = w.get(name)
        if not isinstance(p, dict) or p.get("digest") is None:
            return None
        seen.add((str(p.get("dtype")), json.dumps(p.get("shape")), str(p.get("digest"))))
    if len(seen) != 1:
        return None
    dtype, shape, dig = next(iter(seen))
    return dtype, shape, dig


def _buffers(pairs: list[tuple[RankMeta, RankMeta]], same_layout: bool) -> ContextDiff:
    """Buffers as they were when each run's first step was recorded: a quantised model's weights
    (int8 and scales), and state such as caches."""
    if not same_layout:
        return ContextDiff(category=Category.BUFFERS, compared=False, note="digests are per shard: not compared across layouts")
    items: list[dict[str, Any]] = []
    for model, infos in _by_model(pairs):
        ba = [ta.get("buffers") for ta, _ in infos]
        bb = [tb.get("buffers") for _, tb in infos]
        if not infos or not all(isinstance(x, dict) for x in ba + bb):
            return ContextDiff(category=Category.BUFFERS, compared=False,
                               note="buffers not recorded in both runs" + (f" for stream {model}" if model else ""))
        items += [{**it, "name": _of_model(it["name"], model)} for it in _digest_items(pairs, ba, bb)]
    return _capped(Category.BUFFERS, items, "as at each run's first recorded step")


def _digest_items(pairs: list[tuple[RankMeta, RankMeta]], da: list[dict[str, Any]], db: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tensors (by name, per rank pair) whose recorded digests, shapes or dtypes differ."""
    worlds = (_world(pairs[0][0]), _world(pairs[0][1]))
    items = [it for (ra, rb), a, b in zip(pairs, da, db) for name in sorted(set(a) | set(b))
             if (it := _weight_item(name, a.get(name), b.get(name), (ra.rank, rb.rank), worlds)) is not None]
    return list(_merge_ranks(items).values())


def _world(m: RankMeta) -> int:
    ws = m.attrs.get("world_size")
    return ws if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0 else 1


def _weight_item(name: str, pa: Any, pb: Any, ranks: tuple[int, int], worlds: tuple[int, int]) -> dict[str, Any] | None:
    """How one parameter differs between a rank of A and a rank of B, or None when it does not
    (or cannot be told: digests of shards across layouts)."""
    same_layout = worlds[0] == worlds[1]
    if pa is None or pb is None:
        return {"name": name, "ranks": list(ranks), "a": "absent" if pa is None else "present",
                "b": "absent" if pb is None else "present"}
    if not isinstance(pa, dict) or not isinstance(pb, dict):
        return None
    if pa.get("dtype") != pb.get("dtype") or pa.get("shape") != pb.get("shape") and same_layout:
        return {"name": name, "ranks": list(ranks), "a": f"{pa.get('dtype')} {pa.get('shape')}",
                "b": f"{pb.get('dtype')} {pb.get('shape')}", "why": "shape or dtype"}
    if pa.get("shape") != pb.get("shape"):
        return _shard_shapes(name, pa, pb, ranks, worlds)
    if same_layout and pa.get("digest") != pb.get("digest"):
        return {"name": name, "ranks": list(ranks), "a": _short(pa.get("digest")), "b": _short(pb.get("digest")), "why": "digest"}
    return None


def _shard_shapes(name: str, pa: dict[str, Any], pb: dict[str, Any], ranks: tuple[int, int],
                  worlds: tuple[int, int]) -> dict[str, Any] | None:
    """Across layouts, a parameter whose shapes differ: with both shard layouts recorded
    (``replay.record.weights``), the whole shapes say whether it is the same parameter sharded
    differently (not a difference) or another one; without them it may be a shard."""
    ga, gb = param_global_shape(pa, worlds[0]), param_global_shape(pb, worlds[1])
    if ga is not None and gb is not None:
        if ga == gb:
            return None  # the same whole shape, sharded as recorded
        return {"name": name, "ranks": list(ranks), "a": f"{pa.get('dtype')} {list(ga)} (whole)",
                "b": f"{pb.get('dtype')} {list(gb)} (whole)", "why": "whole shape, from the recorded shard layouts"}
    return {"name": name, "ranks": list(ranks), "a": f"{pa.get('dtype')} {pa.get('shape')}", "b": f"{pb.get('dtype')} {pb.get('shape')}",
            "why": "shape or dtype (the runs are laid out differently and no shard layout is recorded: may be a shard)"}


def _merge_ranks(items: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The same parameter on every rank pair is one difference, named once with its ranks."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for it in items:
        key = (it["name"], it.get("why", ""))
        if key in merged:
            merged[key]["ranks_a"].append(it["ranks"][0])
        else:
            merged[key] = {**{k: v for k, v in it.items() if k != "ranks"}, "ranks_a": [it["ranks"][0]]}
    return merged


def _config(a: RankMeta, b: RankMeta) -> ContextDiff:
    """Each model's config, and how it was called: its factory, its step, and the arguments of
    ``torch.compile`` (another backend or mode computes otherwise)."""
    items: list[dict[str, Any]] = []
    configs = False
    for n, (model, infos) in enumerate(_by_model([(a, b)])):
        if not infos:
            side = "A" if model in _models(a) else "B"
            items.append({"name": _of_model("target", model), "a": "recorded" if side == "A" else "absent",
                          "b": "recorded" if side == "B" else "absent"})
            continue
        found, recorded = _model_config(a, b, infos[0], first=n == 0)
        configs = configs or recorded
        items += _named(model, found)
    scalars, note = _scalar_items(a, b)
    if not configs and not items and scalars is None:
        return ContextDiff(category=Category.CONFIG, compared=False, note="no target config recorded")
    return _whole(Category.CONFIG, items + (scalars or []), note)


def _model_config(a: RankMeta, b: RankMeta, pair: tuple[dict[str, Any], dict[str, Any]], *, first: bool
                  ) -> tuple[list[dict[str, Any]], bool]:
    """One model's config items that differ, its settings and how it was called; and whether
    a config was recorded for it at all."""
    ta, tb = pair
    items: list[dict[str, Any]] = []
    recorded = False
    ca, cb = ta.get("config"), tb.get("config")
    if ca is None and cb is None and first:  # the part's config: its first model's
        ca, cb = a.attrs.get("config"), b.attrs.get("config")
    if ca or cb:  # an empty config on both sides is no config: "the same" would say nothing
        recorded = True
        items += _dict_diff(ca if isinstance(ca, dict) else {"config": ca}, cb if isinstance(cb, dict) else {"config": cb})
    # Settings kept beside the config's fields (HF's attention implementation): recorded
    # apart, since a factory is given the config alone.
    sa, sb = ta.get("config_settings") or {}, tb.get("config_settings") or {}
    if sa or sb:
        recorded = True
        items += _dict_diff({"config": sa}, {"config": sb})
    return items + _how_called(ta, tb), recorded


def _scalar_items(a: RankMeta, b: RankMeta) -> tuple[list[dict[str, Any]] | None, str]:
    """The target's Python attributes that differ at each run's first keyframe (None: neither
    run holds any), and where they were read."""
    if a.scalars is None or b.scalars is None or not (a.scalars[1] or b.scalars[1]):
        return None, ""
    (sa, va), (sb, vb) = a.scalars, b.scalars
    items = [{"name": f"target.{k}", "a": _short(va.get(k, "absent")), "b": _short(vb.get(k, "absent"))}
             for k in sorted(set(va) | set(vb)) if va.get(k, "absent") != vb.get(k, "absent")
             or type(va.get(k)) is not type(vb.get(k))]
    at = f"step {sa}" if sa == sb else f"step {sa} in A, {sb} in B"
    return items, f"the target's Python attributes as at each run's first keyframe ({at})"


def _named(model: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**it, "name": _of_model(it["name"], model)} for it in items]


def _how_called(ta: dict[str, Any], tb: dict[str, Any]) -> list[dict[str, Any]]:
    """The factory, the step callable and the torch.compile arguments, where A's and B's differ."""
    items = [{"name": f"target.{k}", "a": _short(ta.get(k)), "b": _short(tb.get(k))}
             for k in ("factory", "step") if ta.get(k) != tb.get(k)]
    ka, kb = ta.get("compile") or {}, tb.get("compile") or {}
    if ka == kb:
        return items
    if not ka or not kb:
        return items + [{"name": "target.compile", "a": _short(ka) if ka else "not compiled",
                         "b": _short(kb) if kb else "not compiled"}]
    return items + [{**it, "name": f"target.{it['name']}"} for it in _dict_diff({"compile": ka}, {"compile": kb})]


def _numerics(a: RankMeta, b: RankMeta, per_step: dict[str, Any] | None) -> ContextDiff:
    items = _dict_diff({"flags": a.attrs.get("numerics") or {}, "env": a.attrs.get("env") or {}},
                       {"flags": b.attrs.get("numerics") or {}, "env": b.attrs.get("env") or {}})
    la, lb = (_target(a).get("launch") or {}), (_target(b).get("launch") or {})
    if isinstance(la, dict) and isinstance(lb, dict):
        items += _dict_diff({"launch_env": la.get("env_numerics") or {}}, {"launch_env": lb.get("env_numerics") or {}})
    # Per-step numerics contexts (optional): every distinct context each rank ran a step under.
    na, nb = _target(a).get("numerics"), _target(b).get("numerics")
    if isinstance(na, dict) and isinstance(nb, dict):
        step_items, note = _context_changes(na, nb, per_step)
        items += step_items
    elif na is None and nb is None:
        note = "no per-step numerics context recorded"
    else:
        note = f"per-step numerics context recorded in run {'A' if na is not None else 'B'} only"
    return _whole(Category.NUMERICS, items, note)


def _context_changes(na: dict[str, Any], nb: dict[str, Any], per_step: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str]:
    """How the per-step numerics contexts of the two runs differ: at the first step where they
    do (``per_step``, when known), else the first context of each run. (items, note)"""
    if per_step is not None:
        changes = per_step["changes"] or [{"name": "step_context", "a": "?", "b": "?"}]
        items = [{**c, "name": f"step {per_step['step']}: {c['name']}", "steps": per_step["steps_differ"]} for c in changes]
        return items, f"the step contexts first differ at step {per_step['step']} ({per_step['steps_differ']} steps differ)"
    ctx_a, ctx_b = _contexts(na), _contexts(nb)
    if ctx_a == ctx_b:
        return [], ""
    items = _dict_diff({"step_context": (na.get("contexts") or {}).get(na.get("first")) or {}},
                       {"step_context": (nb.get("contexts") or {}).get(nb.get("first")) or {}})
    if len(ctx_a) != len(ctx_b):
        items.append({"name": "step_context.distinct", "a": len(ctx_a), "b": len(ctx_b)})
    return items, ""


def _contexts(n: dict[str, Any]) -> list[str]:
    c = n.get("contexts")
    if not isinstance(c, dict):
        return []
    return sorted(json.dumps(v, sort_keys=True, default=str) for v in c.values())


def _step_contexts(rf: RankFile) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
    """(steps, index into names, names): the numerics context digest each step ran under."""
    t = rf.tables
    s = t.steps
    ids = s["args"].astype(np.int64)
    uniq, inv = np.unique(ids, return_inverse=True)
    names = []
    for i in uniq:
        d = None
        if i >= 0:
            try:
                args = json.loads(t.string(int(i)))
                d = args.get(NUMERICS_ARG) if isinstance(args, dict) else None
            except ValueError:
                d = None
        names.append(d if isinstance(d, str) else "")
    return s["step"].astype(np.int64), inv.reshape(-1), names


def first_numerics_difference(a: RankFile, b: RankFile) -> dict[str, Any] | None:
    """The first common step whose recorded numerics contexts differ, and what differs there.

    Contexts are named by a hash of their canonical JSON, so two runs' steps ran under the same
    context exactly when their digests are equal."""
    na, nb = _target_of(a).get("numerics"), _target_of(b).get("numerics")
    if not isinstance(na, dict) or not isinstance(nb, dict):
        return None
    ca, cb = _step_contexts(a), _step_contexts(b)
    if ca is None or cb is None:
        return None
    sa, ia, names_a = ca
    sb, ib, names_b = cb
    common, xa, xb = np.intersect1d(sa, sb, return_indices=True)
    da = np.array(names_a, dtype=object)[ia[xa]] if common.size else np.zeros(0, dtype=object)
    db = np.array(names_b, dtype=object)[ib[xb]] if common.size else np.zeros(0, dtype=object)
    known = (da != "") & (db != "")
    differ = np.flatnonzero(known & (da != db))
    if not differ.size:
        return None
    i = int(differ[0])
    ctx_a = (na.get("contexts") or {}).get(da[i]) or {}
    ctx_b = (nb.get("contexts") or {}).get(db[i]) or {}
    return {"step": int(common[i]), "steps_differ": int(differ.size),
            "changes": _dict_diff(ctx_a if isinstance(ctx_a, dict) else {}, ctx_b if isinstance(ctx_b, dict) else {})}


def settings_at(a: RankFile, b: RankFile, step: int) -> list[dict[str, Any]] | None:
    """The numerics settings that differ between ``a``'s and ``b``'s contexts at ``step``, each
    with the first common step (up to ``step``) from which its values differ, the newest first:
    a setting that began to differ where the bits did is the likelier cause than one that
    already differed on steps that agreed. None: no per-step contexts in both."""
    na, nb = _target_of(a).get("numerics"), _target_of(b).get("numerics")
    if not isinstance(na, dict) or not isinstance(nb, dict):
        return None
    ca, cb = _step_contexts(a), _step_contexts(b)
    if ca is None or cb is None:
        return None
    common, xa, xb = np.intersect1d(ca[0], cb[0], return_indices=True)
    keep = common <= step
    if not keep.any() or common[keep][-1] != step:
        return None
    contexts_a, contexts_b = na.get("contexts") or {}, nb.get("contexts") or {}
    pairs: dict[tuple[str, str], int] = {}  # (digest a, digest b) -> the first step with that pair
    for s, ia, ib in zip(common[keep].tolist(), ca[1][xa[keep]].tolist(), cb[1][xb[keep]].tolist()):
        pairs.setdefault((ca[2][ia], cb[2][ib]), s)
    last = (ca[2][ca[1][xa[keep]][-1]], cb[2][cb[1][xb[keep]][-1]])
    at_a, at_b = contexts_a.get(last[0]) or {}, contexts_b.get(last[1]) or {}
    if not isinstance(at_a, dict) or not isinstance(at_b, dict):
        return None
    out = [{"name": k, "a": at_a.get(k), "b": at_b.get(k), "since": _since(k, at_a, at_b, pairs, contexts_a, contexts_b, step)}
           for k in sorted(set(at_a) | set(at_b)) if at_a.get(k) != at_b.get(k)]
    return sorted(out, key=lambda c: -c["since"])


def arguments_at(a: RankFile, b: RankFile, step: int) -> list[dict[str, Any]]:
    """The plain (JSON) arguments of ``step`` that differ between ``a`` and ``b`` (a sampling
    temperature one rank passed otherwise), each with the first common step from which its
    values are the ones they have at ``step``, the newest first. Tensors are compared as
    fields; the recorder's own entries and objects recorded by class name are left out."""
    sa, sb = a.tables.steps, b.tables.steps
    common, xa, xb = np.intersect1d(sa["step"].astype(np.int64), sb["step"].astype(np.int64), return_indices=True)
    keep = common <= step
    if not keep.any() or common[keep][-1] != step:
        return []
    ids = np.stack([sa["args"].astype(np.int64)[xa[keep]], sb["args"].astype(np.int64)[xb[keep]]], 1)
    pairs, first = np.unique(ids, axis=0, return_index=True)
    steps = common[keep]
    parsed = {(side, int(i)): _plain_args(rf, int(i)) for side, rf in ((0, a), (1, b)) for i in np.unique(ids[:, side])}
    at_a, at_b = parsed[(0, int(ids[-1, 0]))], parsed[(1, int(ids[-1, 1]))]
    out = []
    for k in sorted(set(at_a) | set(at_b)):
        if at_a.get(k, _ABSENT) == at_b.get(k, _ABSENT):
            continue
        since = min((int(steps[f]) for (ia, ib), f in zip(pairs.tolist(), first.tolist())
                     if parsed[(0, ia)].get(k, _ABSENT) == at_a.get(k, _ABSENT) and parsed[(1, ib)].get(k, _ABSENT) == at_b.get(k, _ABSENT)),
                    default=step)
        out.append({"name": k, "a": _short(at_a.get(k, "absent")), "b": _short(at_b.get(k, "absent")), "since": since})
    return sorted(out, key=lambda c: -c["since"])


_ABSENT = object()


def arguments_difference(a: RankFile, b: RankFile) -> list[dict[str, Any]] | None:
    """The step's plain arguments (a temperature, a top-k) whose values differ between ``a`` and
    ``b`` at a common step: each with the first such step and how many steps differ; None when
    neither recorded any plain argument (nothing to compare)."""
    sa, sb = a.tables.steps, b.tables.steps
    common, xa, xb = np.intersect1d(sa["step"].astype(np.int64), sb["step"].astype(np.int64), return_indices=True)
    if not common.size:
        return None
    ids = np.stack([sa["args"].astype(np.int64)[xa], sb["args"].astype(np.int64)[xb]], 1)
    pairs, first, counts = np.unique(ids, axis=0, return_index=True, return_counts=True)
    found: dict[str, dict[str, Any]] = {}
    any_args = False
    for (ia, ib), f, n in zip(pairs.tolist(), first.tolist(), counts.tolist()):
        pa, pb = _plain_args(a, ia), _plain_args(b, ib)
        any_args = any_args or bool(pa or pb)
        for k in set(pa) | set(pb):
            va, vb = pa.get(k, _ABSENT), pb.get(k, _ABSENT)
            if va == vb and type(va) is type(vb):
                continue
            item = found.get(k)
            step = int(common[f])
            if item is None or step < item["step"]:
                found[k] = {"name": k, "a": _short(va) if va is not _ABSENT else "absent",
                            "b": _short(vb) if vb is not _ABSENT else "absent", "step": step,
                            "steps": (item["steps"] if item else 0) + n}
            else:
                item["steps"] += n
    if not any_args:
        return None
    return sorted(found.values(), key=lambda c: (c["step"], c["name"]))


def _arguments(items: list[dict[str, Any]] | None) -> ContextDiff:
    if items is None:
        return ContextDiff(category=Category.ARGUMENTS, compared=False, note="no plain step argument recorded")
    return _capped(Category.ARGUMENTS, items, "the step's plain arguments, step by step")


def _plain_args(rf: RankFile, sid: int) -> dict[str, Any]:
    """A step's recorded non-tensor arguments that are plain values (numbers, strings, lists)."""
    if sid < 0:
        return {}
    try:
        args = json.loads(rf.tables.string(sid))
    except ValueError:
        return {}
    return {k: v for k, v in args.items() if not k.startswith("__") and not isinstance(v, dict)} if isinstance(args, dict) else {}


def _since(k: str, at_a: dict[str, Any], at_b: dict[str, Any], pairs: dict[tuple[str, str], int],
           contexts_a: dict[str, Any], contexts_b: dict[str, Any], step: int) -> int:
    """The first step at which setting ``k`` had the values it has at ``step`` on both sides."""
    return min((s for (da, db), s in pairs.items()
                if (contexts_a.get(da) or {}).get(k) == at_a.get(k) and (contexts_b.get(db) or {}).get(k) == at_b.get(k)),
               default=step)


def _target_of(rf: RankFile) -> dict[str, Any]:
    t = rf.attrs.get("target")
    return t if isinstance(t, dict) else {}


def _tuner(pairs: list[tuple[RankMeta, RankMeta]]) -> ContextDiff:
    items = []
    for a, b in pairs:
        ca, cb = a.tuner, b.tuner
        for op in sorted(set(ca) | set(cb)):
            if ca.get(op) != cb.get(op):
                items.append({"name": op, "rank_a": a.rank, "rank_b": b.rank,
                              "a": ca.get(op, "default"), "b": cb.get(op, "default")})
    return _capped(Category.TUNER, items)


def _graph_kernels(rf: RankFile) -> dict[str, list[str]]:
    t = rf.tables
    out: dict[str, list[str]] = {}
    for g in t.graphs:
        ks = t.kernels[t.kernels["graph"] == g["graph"]]
        out[t.string(int(g["key"]))] = [short_kernel_name(t.string(int(k["name"]))) for k in np.sort(ks, order="ordinal")]
    return out


def _kernels(pairs: list[tuple[RankMeta, RankMeta]]) -> ContextDiff:
    items = []
    for a, b in pairs:
        ga, gb = a.kernels, b.kernels
        for key in sorted(set(ga) | set(gb)):
            ka, kb = ga.get(key), gb.get(key)
            if ka == kb:
                continue
            if ka is None or kb is None:
                items.append({"name": key, "rank_a": a.rank, "rank_b": b.rank,
                              "a": "not captured" if ka is None else f"{len(ka)} kernels",
                              "b": "not captured" if kb is None else f"{len(kb)} kernels"})
                continue
            i = next(i for i in range(max(len(ka), len(kb)) + 1) if ka[i:i + 1] != kb[i:i + 1])
            items.append({"name": key, "rank_a": a.rank, "rank_b": b.rank, "first_difference": i,
                          "a": ka[i] if i < len(ka) else "(end)", "b": kb[i] if i < len(kb) else "(end)",
                          "counts": [len(ka), len(kb)]})
    return _capped(Category.KERNELS, items)


def _versions(a: RankMeta, b: RankMeta, ma: Mapping[str, Any], mb: Mapping[str, Any]) -> ContextDiff:
    items = _dict_diff(a.attrs.get("versions") or {}, b.attrs.get("versions") or {})
    items += _dict_diff({"manifest": {k: ma.get(k) for k in ("versions", "replay_version") if k in ma}},
                        {"manifest": {k: mb.get(k) for k in ("versions", "replay_version") if k in mb}})
    return _whole(Category.VERSIONS, items)


def _environment(a: RankMeta, b: RankMeta, ma: Mapping[str, Any], mb: Mapping[str, Any]) -> ContextDiff:
    items = []
    for k in ("command", "exit_code", "host"):
        if ma.get(k) != mb.get(k):
            items.append({"name": f"manifest.{k}", "a": _short(ma.get(k)), "b": _short(mb.get(k))})
    for k in ("world_size", "host", "platform", "gpus"):
        if a.attrs.get(k) != b.attrs.get(k):
            items.append({"name": k, "a": _short(a.attrs.get(k)), "b": _short(b.attrs.get(k))})
    ta, tb = _target(a), _target(b)
    if ta.get("device") != tb.get("device"):
        items.append({"name": "target.device", "a": _short(ta.get("device")), "b": _short(tb.get("device"))})
    # Variables the program started with (digests of their values): a program that reads BAN=1
    # or a LoRA path computes otherwise, and no tensor of the recording says why.
    la, lb = ta.get("launch") if isinstance(ta.get("launch"), dict) else {}, tb.get("launch") if isinstance(tb.get("launch"), dict) else {}
    items += [{"name": f"env.{n}", "a": va, "b": vb}
              for n, va, vb in recorded_env_differences(la.get("env_digests"), lb.get("env_digests"))]
    # What the recorder kept (digests or full tensors) decides what can be compared, not what ran.
    items += _dict_diff({"recorder": a.attrs.get("recorder") or {}}, {"recorder": b.attrs.get("recorder") or {}})
    return _whole(Category.ENVIRONMENT, [i for i in items if not i["name"].startswith(("recorder.out", "recorder.rank", "recorder.part", "recorder.world_size"))])


def context_differences(
    pairs: list[tuple[RankMeta, RankMeta]], manifest_a: Mapping[str, Any], manifest_b: Mapping[str, Any], *, same_layout: bool,
    numerics_per_step: Sequence[dict[str, Any] | None] | None = None, arguments: list[dict[str, Any]] | None = None,
) -> list[ContextDiff]:
    """Every category, most likely cause first. ``pairs`` are the rank files compared, each
    category over every pair (metadata only); ``numerics_per_step``, per pair, the first step
    whose numerics contexts differ (``first_numerics_difference``).

    Settings (config, numerics) come before buffers: a buffer is often state the run computed
    before its first recorded step (a cache the prefill filled), which a setting that differs
    explains, not the other way round."""
    per_step = {(a.rank, b.rank): n for (a, b), n in zip(pairs, numerics_per_step or [])}
    return [
        _weights(pairs, same_layout),
        _over_pairs(pairs, _config),
        _arguments(arguments),
        _over_pairs(pairs, lambda a, b: _numerics(a, b, per_step.get((a.rank, b.rank)))),
        _buffers(pairs, same_layout),
        _tuner(pairs),
        _kernels(pairs),
        _over_pairs(pairs, lambda a, b: _versions(a, b, manifest_a, manifest_b)),
        _over_pairs(pairs, lambda a, b: _environment(a, b, manifest_a, manifest_b)),
    ]
