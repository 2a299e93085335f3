"""Bisection across settings: the smallest set of toggles that makes a divergent step match.

The toggles are those the target declares (``Target.toggles()``: for the reference engine CUDA
graph, tuner mode, deterministic algorithms, TF32, nondeterministic combine, one-shot all-reduce,
token broadcast, the graph-hazard bugs, forced tactics). A *change* sets one toggle to another
value than recorded; a *probe* re-runs the step with a set of changes in fresh processes
(``replay.bisect.probe``) and says whether the step *matches*. What matches means is the
criterion, chosen from the recording unless given:

- ``ranks`` (rank R is an odd one out at step S): the targets of rank R and of a reference rank
  M (the lowest of the majority, or ``against``) both re-run M's recorded step (its keyframe,
  inputs, RNG and collectives) with the same changes; the step matches when their outputs have
  the same bits. On the same data only what the rank changes (rank-specific settings, its tuner
  choices) differs, so state a rank carried over from before the recording (a prefill that
  already diverged) does not hide a fix. Re-running M too, rather than comparing with its
  recorded digests, lets a change that every rank would make (deterministic algorithms, no
  TF32) count as a fix. Ranks whose parameters differ (tensor-parallel shards) cannot share
  data: use ``live``.
- ``eager`` (one rank, or R agrees with the others, and the step ran as a CUDA graph): rank R is
  re-run as a graph and eagerly with the same changes; it matches when both give the same bits.
  The ``cudagraph`` toggle itself is not a candidate: turning it off matches trivially.
- ``live`` (asked for): every rank is re-run at once with live collectives (gloo or NCCL); it
  matches when all ranks give the same bits. Needed when a change alters the collectives a step
  makes (one-shot all-reduce, token broadcast), which recorded collectives cannot answer.

The baseline (no change) must diverge. It runs from the recorded configuration alone; if that
does not reproduce rank R's recorded outputs and R recorded tuner choices, it runs with those
choices, and ``tuner_choices`` (the reference rank's choices, or rank 0's) becomes a candidate.

Delta debugging (``ddmin``) then finds a 1-minimal set of changes that matches. The probes'
answers are kept in ``<recording>/results/bisect-state-*.json``, so an interrupted bisection
resumes and a finished one answers again without a probe.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as _field
from pathlib import Path
from typing import Any

from replay.analysis.divergence import vote
from replay.bisect.ddmin import ddmin
from replay.bisect.probe import run_live, run_single
from replay.bisect.state import BisectState
from replay.errors import OutOfRange, RerunError, UsageError
from replay.format.reader import Part, Recording
from replay.format.tables import combine_digests
from replay.rerun.target import TargetSpec

__all__ = ["CRITERIA", "Change", "ConfigBisectSettings", "ConfigBisection", "ProbeRecord", "bisect_config"]

CRITERIA = ("ranks", "eager", "live")
TUNER_CHOICES = "tuner_choices"


@dataclass(kw_only=True, slots=True)
class ConfigBisectSettings:
    """What ``replay bisect --config`` is asked; the click options map onto these fields."""

    rank: int
    """The rank whose step diverges."""
    step: int
    """The step to make match."""
    toggles: list[str] | None = None
    """Toggles to try, ``name`` or ``name=JSON`` (another value than recorded); None: all declared."""
    criterion: str | None = None
    """``ranks``, ``eager`` or ``live`` (see the module docstring); None: chosen from the recording."""
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
        if self.against is not None and self.criterion not in (None, "ranks"):
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
    outcome: str  # "matches" | "differs" | "error"
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
    criterion: str
    reference: int | None
    status: str  # "done" | "incomplete" | "no-divergence" | "no-fix"
    candidates: list[Change]
    tried: list[ProbeRecord]
    minimal: list[Change] | None
    tuner_policy: str
    state_path: str
    probes_run: int = 0
    notes: list[str] = _field(default_factory=list)

    def describe_criterion(self) -> str:
        if self.criterion == "ranks":
            return f"rank {self.reference} (both re-run with the same toggles)"
        if self.criterion == "eager":
            return "its eager re-run (CUDA graph against eager, same toggles)"
        return "every other rank (all re-run at once, live collectives)"

    def verdict(self) -> str:
        head = f"rank {self.rank}, step {self.step}: "
        cached = sum(1 for t in self.tried if t.cached)
        cost = f"{len(self.tried)} probes" + (f", {cached} answered from the saved state" if cached else "")
        if self.status == "no-divergence":
            return head + f"re-run with the recorded settings it already matches {self.describe_criterion()}: nothing to bisect"
        if self.status == "no-fix":
            return head + f"no combination of the {len(self.candidates)} toggles tried makes it match {self.describe_criterion()} ({cost})"
        if self.status == "incomplete":
            return head + f"stopped after {self.probes_run} new probes (--max-probes); run the same command again to resume"
        names = ", ".join(c.label for c in self.minimal or [])
        return head + f"the smallest set of toggles that makes it match {self.describe_criterion()}: {names} ({cost})"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "bisect-config",
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


class _Budget(Exception):
    """The probe budget of this invocation is spent."""


def _outputs_at(part: Part, rank: int, step: int) -> dict[str, int]:
    """Recorded output digests (``output.*`` and ``tokens.*``) of ``rank`` at ``step``, by output name."""
    out = {}
    for name, d in part[rank].step(step).fields():
        for prefix in ("output.", "tokens."):
            if name.startswith(prefix):
                out[name[len(prefix):]] = d
    return out


def _vote_at(part: Part, step: int) -> tuple[list[int], list[int]]:
    values = {}
    for r in part:
        try:
            outs = _outputs_at(part, r, step)
        except OutOfRange:
            continue
        values[r] = combine_digests(outs[k] for k in sorted(outs))
    return vote(values) if values else ([], [])


def _choose_criterion(part: Part, s: ConfigBisectSettings) -> tuple[str, int | None]:
    if s.criterion == "live":
        return "live", None
    if s.criterion == "eager":
        return "eager", None
    if s.against is not None:
        part[s.against].step(s.step)
        if s.against == s.rank:
            raise UsageError("--against must name another rank than --rank")
        return "ranks", s.against
    majority, odd = _vote_at(part, s.step)
    if s.criterion == "ranks" or (len(part) > 1 and s.rank in odd):
        ref = next((r for r in majority if r != s.rank), None)
        if ref is None:
            raise UsageError(f"rank {s.rank} is in the majority at step {s.step}: give --against M, the rank to match")
        return "ranks", ref
    if part[s.rank].step(s.step).mode == "graph":
        return "eager", None
    if len(part) > 1:
        raise UsageError(f"rank {s.rank} agrees with the majority at step {s.step} and the step ran eagerly: nothing "
                         "diverges there; pick an odd rank and step (`replay bisect --steps`), or use --criterion live")
    raise UsageError(f"step {s.step} ran eagerly on the only rank: there is nothing to compare it with; "
                     "use --criterion eager to compare a CUDA graph re-run with an eager one")


def _parse_toggle(text: str) -> tuple[str, Any, bool]:
    name, sep, value = text.partition("=")
    if not sep:
        return name.strip(), None, False
    try:
        return name.strip(), json.loads(value), True
    except ValueError:
        return name.strip(), value, True


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def _candidates(declared: dict[str, list[Any]], recorded: dict[str, Any], wanted: list[str] | None,
                exclude: set[str]) -> tuple[list[Change], list[str]]:
    notes: list[str] = []
    specs = [_parse_toggle(t) for t in wanted] if wanted else [(n, None, False) for n in declared]
    unknown = [n for n, _, _ in specs if n not in declared]
    if unknown:
        raise UsageError(f"--toggles: the target declares no toggle {', '.join(unknown)} "
                         f"(it declares: {', '.join(declared) or 'none'})")
    out = []
    for name, value, given in specs:
        if name in exclude:
            if wanted:
                notes.append(f"{name} is not a candidate under this criterion (it is what the criterion compares)")
            continue
        values = declared[name]
        was = recorded.get(name, values[0] if values else None)
        if not given:
            others = [v for v in values if _canon(v) != _canon(was)]
            if not others:
                notes.append(f"{name} declares no other value than the recorded {json.dumps(was, default=str)}")
                continue
            value = others[0]
        elif _canon(value) == _canon(was):
            raise UsageError(f"--toggles {name}={json.dumps(value)} is the recorded value: name another")
        out.append(Change(name, value, was))
    return out, notes


def _outcome(result: dict[str, Any], outputs: set[str]) -> tuple[str, str | None]:
    if result.get("error"):
        return "error", str(result["error"])
    sides = result.get("sides") or []
    bad = next((s for s in sides if s.get("error")), None)
    if bad is not None:
        return "error", f"{bad.get('label')}: {bad['error']}"
    digs = [{k: v for k, v in (s.get("digests") or {}).items() if k in outputs} for s in sides]
    if not sides or any(not d for d in digs):
        return "error", "a probe re-ran the step but returned none of its recorded outputs"
    return ("matches" if all(d == digs[0] for d in digs) else "differs"), None


def bisect_config(
    recording: Path,
    part_name: str,
    settings: ConfigBisectSettings,
    *,
    announce: Callable[[str], None] = lambda s: None,
    on_probe: Callable[[ProbeRecord], None] = lambda p: None,
) -> ConfigBisection:
    """Find the smallest set of toggle changes that makes ``settings.step`` match (module docstring)."""
    s = settings
    recording = Path(recording)
    with Recording(recording) as rec:
        part = rec[part_name]
        rf = part[s.rank]
        rf.step(s.step)
        spec = TargetSpec.from_rank_file(rf)
        criterion, ref = _choose_criterion(part, s)
        world = part.world_size
        ranks = list(part)
        if criterion == "live":
            if ranks != list(range(world)):
                raise RerunError(f"--criterion live re-runs every rank together, but this part holds ranks {ranks} of {world}")
            for r in ranks:
                part[r].step(s.step)
            if s.device.startswith("cuda"):
                import torch

                if torch.cuda.device_count() < len(ranks):
                    raise UsageError(f"--criterion live runs the {len(ranks)} ranks at once, one GPU each, but "
                                     f"{torch.cuda.device_count()} GPU(s) are here: use --device cpu")
        outputs = set(_outputs_at(part, s.rank, s.step))
        recorded_cfg = spec.config if isinstance(spec.config, dict) else {}
        step_mode = "cudagraph" if rf.step(s.step).mode == "graph" else "eager"
        choices = {r: {k: v for k, v in part[r].tuner_choices().items() if not k.startswith("triton:")} for r in ranks}
    key = {"part": part_name, "rank": s.rank, "step": s.step, "criterion": criterion, "reference": ref,
           "toggles": s.toggles, "device": s.device, "factory": s.factory, "options": s.options}
    state = BisectState(recording, key, fresh=s.fresh)
    if state.resumed:
        announce(f"resuming the bisection saved in {state.path}")
    tried: list[ProbeRecord] = []
    budget = {"new": 0}

    def mode_for(opts: dict[str, Any]) -> str:
        if "cudagraph" in opts:
            return "cudagraph" if opts["cudagraph"] else "eager"
        if "cudagraph" in recorded_cfg:
            return "cudagraph" if recorded_cfg["cudagraph"] else "eager"
        return step_mode

    def request(changes: list[Change], policy: str) -> dict[str, Any]:
        opts: dict[str, Any] = dict(s.options)
        if policy == "config" and any(choices.values()):
            opts[TUNER_CHOICES] = {}  # the recorded configuration alone decides the tactics
        opts.update({c.name: c.value for c in changes})
        if criterion == "eager":
            sides = [{"label": "cudagraph", "rank": s.rank, "mode": "cudagraph", "options": {**opts, "cudagraph": True}},
                     {"label": "eager", "rank": s.rank, "mode": "eager", "options": {**opts, "cudagraph": False}}]
        else:
            who = [s.rank, ref] if criterion == "ranks" else ranks
            data = {r: (ref if criterion == "ranks" else r) for r in who}
            sides = [{"label": f"rank {r}", "rank": r, "data": data[r], "mode": mode_for(opts), "options": opts} for r in who]
        return {"recording": str(recording), "part": part_name, "step": s.step, "device": s.device,
                "factory": s.factory, "sides": sides}

    def run(changes: list[Change], policy: str) -> ProbeRecord:
        label_key = _canon({"policy": policy, "changes": sorted(c.label for c in changes)})
        labels = [c.label for c in changes]
        saved = state.probes.get(label_key)
        if saved is not None:
            rec_ = ProbeRecord(labels, saved["outcome"], True, saved.get("seconds", 0.0), saved.get("error"), saved.get("sides", []))
            tried.append(rec_)
            on_probe(rec_)
            return rec_
        if s.max_probes is not None and budget["new"] >= s.max_probes:
            raise _Budget()
        req = request(changes, policy)
        t0 = time.perf_counter()
        if criterion == "live":
            devs = [f"cuda:{i}" for i in range(len(ranks))] if s.device.startswith("cuda") else ["cpu"] * len(ranks)
            result = run_live({**req, "devices": devs}, timeout_s=s.timeout_s)
        else:
            result = run_single(req, timeout_s=s.timeout_s)
        budget["new"] += 1
        outcome, err = _outcome(result, outputs)
        rec_ = ProbeRecord(labels, outcome, False, time.perf_counter() - t0, err, list(result.get("sides") or []))
        state.probes[label_key] = {"toggles": labels, "outcome": outcome, "error": err, "seconds": rec_.seconds,
                                   "sides": [{k: x.get(k) for k in ("label", "rank", "data", "mode", "digests", "reproduces", "error", "toggles", "params")}
                                             for x in rec_.sides]}
        state.save()
        tried.append(rec_)
        on_probe(rec_)
        return rec_

    result = ConfigBisection(recording=str(recording), part=part_name, rank=s.rank, step=s.step, criterion=criterion,
                             reference=ref, status="incomplete", candidates=[], tried=tried, minimal=None,
                             tuner_policy="config", state_path=str(state.path))
    try:
        # The baseline. Tactics come from the recorded configuration alone, unless that hides the
        # divergence and the ranks recorded different tuner choices: then each rank's own choices.
        pair = [s.rank, ref] if criterion == "ranks" and ref is not None else ranks
        mixed = len({_canon(choices.get(r) or {}) for r in pair}) > 1
        policy = "recorded" if criterion == "eager" and choices.get(s.rank) else "config"
        base = run([], policy)
        if base.outcome == "error":
            hint = " (a change of collectives needs --criterion live)" if "collective" in (base.error or "") else ""
            raise RerunError(f"the baseline probe of rank {s.rank}, step {s.step} failed: {base.error}{hint}")
        if base.outcome == "matches" and policy == "config" and mixed:
            again = run([], "recorded")
            if again.outcome == "differs":
                policy, base = "recorded", again
                result.notes.append("with the recorded configuration alone the step matches; with each rank's recorded tuner "
                                    "choices it diverges: probes use the recorded choices, and tuner_choices is a candidate")
        for x in base.sides:
            if x.get("rank") == x.get("data") and x.get("reproduces") is False and x.get("mode") == step_mode:
                result.notes.append(f"the re-run of rank {x.get('rank')} does not reproduce its recorded outputs at step "
                                    f"{s.step} (nondeterminism, or another environment)")
        result.tuner_policy = policy
        if criterion == "ranks" and len({x.get("params") for x in base.sides}) > 1:
            raise UsageError(f"ranks {s.rank} and {ref} hold different parameters (tensor-parallel shards?), so they cannot "
                             "re-run the same data: use --criterion live")
        if base.outcome == "matches":
            result.status = "no-divergence"
            return _finish(result, state)
        declared = next((x.get("toggles") for x in base.sides if x.get("toggles")), None) or {}
        if not declared:
            raise UsageError(f"the target ({spec.factory or spec.step}) declares no toggles (a replay_toggles() method) to bisect over")
        changes, notes = _candidates(declared, recorded_cfg, s.toggles, {"cudagraph"} if criterion == "eager" else set())
        result.notes += notes
        if policy == "recorded" and criterion != "eager":
            to = ref if ref is not None else 0
            if choices.get(to) != choices.get(s.rank):
                changes.append(Change(TUNER_CHOICES, choices.get(to) or {}, "recorded", shown=f"rank {to}'s"))
        result.candidates = changes
        if not changes:
            raise UsageError("no toggle is left to try: name toggles with --toggles, or pick another criterion")

        def flips(subset: list[Change]) -> bool:
            return run(subset, policy).outcome == "matches"

        start: list[Change] | None = changes if flips(changes) else None
        if start is None:
            # One change may break the probe (an error) or undo the fix: try leaving each out once.
            for c in changes if len(changes) > 1 else []:
                rest = [x for x in changes if x is not c]
                if flips(rest):
                    start = rest
                    result.notes.append(f"with every change the step does not match; without {c.label} it does")
                    break
        if start is None:
            result.status = "no-fix"
            errs = [t for t in tried if t.outcome == "error"]
            if errs:
                result.notes.append(f"{len(errs)} probe(s) failed, e.g. {errs[0].error}")
            return _finish(result, state)
        result.minimal = ddmin(start, flips)
        result.status = "done"
    except _Budget:
        result.status = "incomplete"
        result.notes.append(f"the state is saved in {state.path}")
    finally:
        result.probes_run = budget["new"]
    return _finish(result, state)


def _finish(result: ConfigBisection, state: BisectState) -> ConfigBisection:
    if result.status != "incomplete":
        state.data["done"] = True
        state.data["result"] = {"status": result.status, "minimal": [c.label for c in result.minimal] if result.minimal else None}
        state.save()
    return result
