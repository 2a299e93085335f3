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
- ``reproduce`` (asked for, or the only rank ran the step eagerly): rank R alone re-runs its own
  recorded step (keyframe, inputs, RNG, collectives, tuner choices); it matches when its outputs
  have the bits it recorded. The answer is the smallest set of toggles that makes the re-run
  reproduce the recording: what the recording environment had that this re-run does not.

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
from pathlib import Path
from typing import Any

from replay.analysis.divergence import vote
from replay.bisect.config_model import CRITERIA, Change, ConfigBisection, ConfigBisectSettings, Criterion, ProbeRecord
from replay.bisect.ddmin import ddmin
from replay.bisect.probe import run_live, run_single
from replay.bisect.state import BisectState
from replay.errors import OutOfRange, RerunError, UsageError
from replay.format.reader import Part, Recording
from replay.format.tables import combine_digests
from replay.rerun.target import TargetSpec
from replay.states import BisectStatus, ProbeOutcome

__all__ = ["CRITERIA", "Change", "ConfigBisectSettings", "ConfigBisection", "ConfigSearch", "Criterion", "ProbeRecord",
           "bisect_config"]

TUNER_CHOICES = "tuner_choices"
_SIDE_KEYS = ("label", "rank", "data", "mode", "digests", "reproduces", "error", "toggles", "params")


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


def choose_criterion(part: Part, s: ConfigBisectSettings) -> tuple[Criterion, int | None]:
    """The criterion asked for, or the one the recording calls for, and its reference rank."""
    assert s.rank is not None and s.step is not None
    if s.criterion in (Criterion.LIVE, Criterion.EAGER, Criterion.REPRODUCE):
        return Criterion(s.criterion), None
    if s.against is not None:
        part[s.against].step(s.step)
        if s.against == s.rank:
            raise UsageError("--against must name another rank than --rank")
        return Criterion.RANKS, s.against
    majority, odd = _vote_at(part, s.step)
    if s.criterion == Criterion.RANKS or (len(part) > 1 and s.rank in odd):
        ref = next((r for r in majority if r != s.rank), None)
        if ref is None:
            raise UsageError(f"rank {s.rank} is in the majority at step {s.step}: give --against M, the rank to match")
        return Criterion.RANKS, ref
    if part[s.rank].step(s.step).mode == "graph":
        return Criterion.EAGER, None
    if len(part) > 1:
        raise UsageError(f"rank {s.rank} agrees with the majority at step {s.step} and the step ran eagerly: nothing "
                         "diverges there; pick an odd rank and step (`replay bisect steps`), or use --criterion live "
                         "or --criterion reproduce")
    return Criterion.REPRODUCE, None  # the only rank, run eagerly: match what it recorded


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


def candidates(declared: dict[str, list[Any]], recorded: dict[str, Any], wanted: list[str] | None,
               exclude: set[str]) -> tuple[list[Change], list[str]]:
    """The changes to try (``wanted``, or one other value of every declared toggle), and notes on
    toggles left out."""
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


def probe_outcome(result: dict[str, Any], outputs: dict[str, str] | set[str],
                  recorded: dict[str, str] | None = None) -> tuple[ProbeOutcome, str | None]:
    """``matches`` when every side gave the same bits for the recorded ``outputs`` (and, with
    ``recorded``, the bits recorded); ``error`` when a side failed or returned none of them."""
    if result.get("error"):
        return ProbeOutcome.ERROR, str(result["error"])
    sides = result.get("sides") or []
    bad = next((s for s in sides if s.get("error")), None)
    if bad is not None:
        return ProbeOutcome.ERROR, f"{bad.get('label')}: {bad['error']}"
    digs = [{k: v for k, v in (s.get("digests") or {}).items() if k in outputs} for s in sides]
    if not sides or any(not d for d in digs):
        return ProbeOutcome.ERROR, "a probe re-ran the step but returned none of its recorded outputs"
    want = recorded if recorded is not None else digs[0]
    return (ProbeOutcome.MATCHES if all(d == want for d in digs) else ProbeOutcome.DIFFERS), None


class ConfigSearch:
    """One configuration bisection: read what the recording says, probe, search (module docstring).

    The steps are methods in the order ``run`` calls them: the baseline (``baseline``), the
    candidate changes (``changes``), a starting set that matches (``start``), then ``ddmin``.
    Every probe goes through ``probe``, which answers from the saved state when it can.
    """

    def __init__(self, recording: Path, part_name: str, settings: ConfigBisectSettings, *,
                 announce: Callable[[str], None], on_probe: Callable[[ProbeRecord], None]) -> None:
        if settings.rank is None or settings.step is None:
            raise UsageError("a configuration bisection needs a rank and a step (replay.api.bisect_config chooses them)")
        self.s = settings
        self.rank, self.step = settings.rank, settings.step
        self.recording = Path(recording)
        self.part_name = part_name
        self.on_probe = on_probe
        self._read_recording()
        key = {"part": part_name, "rank": self.rank, "step": self.step, "criterion": self.criterion, "reference": self.ref,
               "toggles": settings.toggles, "device": settings.device, "factory": settings.factory, "options": settings.options,
               # The factory's source as it is now: a bisection saved before it was edited (toggles
               # added) is not resumed.
               "factory_source": _module_source_digest(settings.factory or self.spec.factory)}
        self.state = BisectState(self.recording, key, fresh=settings.fresh)
        if self.state.resumed:
            announce(f"resuming the bisection saved in {self.state.path}")
        self.tried: list[ProbeRecord] = []
        self.new_probes = 0
        self.result = ConfigBisection(recording=str(self.recording), part=part_name, rank=self.rank, step=self.step,
                                      criterion=self.criterion, reference=self.ref, status=BisectStatus.INCOMPLETE,
                                      candidates=[], tried=self.tried, minimal=None, tuner_policy="config",
                                      state_path=str(self.state.path))

    # -- what the recording says ------------------------------------------------------------

    def _read_recording(self) -> None:
        s = self.s
        with Recording(self.recording) as rec:
            part = rec[self.part_name]
            rf = part[self.rank]
            rf.step(self.step)
            self.spec = TargetSpec.from_rank_file(rf)
            self.criterion, self.ref = choose_criterion(part, s)
            self.ranks = list(part)
            if self.criterion == Criterion.LIVE:
                self._check_live(part)
            recorded = _outputs_at(part, self.rank, self.step)
            self.outputs = set(recorded)
            self.recorded_hex = {k: f"{v:016x}" for k, v in recorded.items()}
            self.recorded_cfg = self.spec.config if isinstance(self.spec.config, dict) else {}
            self.step_mode = "cudagraph" if rf.step(self.step).mode == "graph" else "eager"
            self.choices = {r: {k: v for k, v in part[r].tuner_choices().items() if not k.startswith("triton:")}
                            for r in self.ranks}

    def _check_live(self, part: Part) -> None:
        world = part.world_size
        if self.ranks != list(range(world)):
            raise RerunError(f"--criterion live re-runs every rank together, but this part holds ranks {self.ranks} of {world}")
        for r in self.ranks:
            part[r].step(self.step)
        if self.s.device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < len(self.ranks):
                raise UsageError(f"--criterion live runs the {len(self.ranks)} ranks at once, one GPU each, but "
                                 f"{torch.cuda.device_count()} GPU(s) are here: use --device cpu")

    # -- one probe --------------------------------------------------------------------------

    def mode_for(self, opts: dict[str, Any]) -> str:
        if "cudagraph" in opts:
            return "cudagraph" if opts["cudagraph"] else "eager"
        if "cudagraph" in self.recorded_cfg:
            return "cudagraph" if self.recorded_cfg["cudagraph"] else "eager"
        return self.step_mode

    def sides(self, opts: dict[str, Any]) -> list[dict[str, Any]]:
        r = self.rank
        if self.criterion == Criterion.EAGER:
            return [{"label": "cudagraph", "rank": r, "mode": "cudagraph", "options": {**opts, "cudagraph": True}},
                    {"label": "eager", "rank": r, "mode": "eager", "options": {**opts, "cudagraph": False}}]
        if self.criterion == Criterion.REPRODUCE:
            return [{"label": f"rank {r}", "rank": r, "data": r, "mode": self.mode_for(opts), "options": opts}]
        who = [r, self.ref] if self.criterion == Criterion.RANKS else self.ranks
        data = {x: (self.ref if self.criterion == Criterion.RANKS else x) for x in who}
        return [{"label": f"rank {x}", "rank": x, "data": data[x], "mode": self.mode_for(opts), "options": opts} for x in who]

    def request(self, changes: list[Change], policy: str) -> dict[str, Any]:
        opts: dict[str, Any] = dict(self.s.options)
        if policy == "config" and any(self.choices.values()):
            opts[TUNER_CHOICES] = {}  # the recorded configuration alone decides the tactics
        opts.update({c.name: c.value for c in changes})
        return {"recording": str(self.recording), "part": self.part_name, "step": self.step, "device": self.s.device,
                "factory": self.s.factory, "sides": self.sides(opts)}

    def _saved(self, labels: list[str], key: str) -> ProbeRecord | None:
        saved = self.state.probes.get(key)
        if saved is None:
            return None
        return ProbeRecord(labels, ProbeOutcome(saved["outcome"]), True, saved.get("seconds", 0.0), saved.get("error"),
                           saved.get("sides", []))

    def _execute(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.criterion == Criterion.LIVE:
            n = len(self.ranks)
            devs = [f"cuda:{i}" for i in range(n)] if self.s.device.startswith("cuda") else ["cpu"] * n
            return run_live({**req, "devices": devs}, timeout_s=self.s.timeout_s)
        return run_single(req, timeout_s=self.s.timeout_s)

    def probe(self, changes: list[Change], policy: str) -> ProbeRecord:
        """The answer for ``changes`` under tuner ``policy``: saved, or from a new probe."""
        key = _canon({"policy": policy, "changes": sorted(c.label for c in changes)})
        labels = [c.label for c in changes]
        rec = self._saved(labels, key)
        if rec is None:
            if self.s.max_probes is not None and self.new_probes >= self.s.max_probes:
                raise _Budget()
            t0 = time.perf_counter()
            result = self._execute(self.request(changes, policy))
            self.new_probes += 1
            recorded = self.recorded_hex if self.criterion == Criterion.REPRODUCE else None
            outcome, err = probe_outcome(result, self.outputs, recorded)
            rec = ProbeRecord(labels, outcome, False, time.perf_counter() - t0, err, list(result.get("sides") or []))
            self.state.probes[key] = {"toggles": labels, "outcome": outcome, "error": err, "seconds": rec.seconds,
                                      "sides": [{k: x.get(k) for k in _SIDE_KEYS} for x in rec.sides]}
            self.state.save()
        self.tried.append(rec)
        self.on_probe(rec)
        return rec

    # -- the search -------------------------------------------------------------------------

    def baseline(self) -> tuple[ProbeRecord, str]:
        """The probe with no change, and the tuner policy the search keeps.

        Tactics come from the recorded configuration alone, unless that hides the divergence and
        the ranks recorded different tuner choices: then each rank's own choices. Reproducing the
        recording uses the recorded choices from the start."""
        pair = [self.rank, self.ref] if self.criterion == Criterion.RANKS and self.ref is not None else self.ranks
        mixed = len({_canon(self.choices.get(r) or {}) for r in pair}) > 1
        own = self.criterion in (Criterion.EAGER, Criterion.REPRODUCE) and self.choices.get(self.rank)
        policy = "recorded" if own else "config"
        base = self.probe([], policy)
        if base.outcome == ProbeOutcome.ERROR:
            hint = " (a change of collectives needs --criterion live)" if "collective" in (base.error or "") else ""
            raise RerunError(f"the baseline probe of rank {self.rank}, step {self.step} failed: {base.error}{hint}")
        if base.outcome == ProbeOutcome.MATCHES and policy == "config" and mixed:
            again = self.probe([], "recorded")
            if again.outcome == ProbeOutcome.DIFFERS:
                policy, base = "recorded", again
                self.result.notes.append("with the recorded configuration alone the step matches; with each rank's recorded "
                                         "tuner choices it diverges: probes use the recorded choices, and tuner_choices is a candidate")
        return base, policy

    def _note_baseline(self, base: ProbeRecord) -> None:
        if self.criterion == Criterion.REPRODUCE:
            return  # not reproducing the recording is what this criterion bisects
        for x in base.sides:
            if x.get("rank") == x.get("data") and x.get("reproduces") is False and x.get("mode") == self.step_mode:
                self.result.notes.append(f"the re-run of rank {x.get('rank')} does not reproduce its recorded outputs at step "
                                         f"{self.step} (nondeterminism, or another environment; --criterion reproduce "
                                         "bisects that)")
        if self.criterion == Criterion.RANKS and len({x.get("params") for x in base.sides}) > 1:
            raise UsageError(f"ranks {self.rank} and {self.ref} hold different parameters (tensor-parallel shards?), so they "
                             "cannot re-run the same data: use --criterion live")

    def changes(self, base: ProbeRecord, policy: str) -> list[Change]:
        declared = next((x.get("toggles") for x in base.sides if x.get("toggles")), None) or {}
        if not declared:
            raise UsageError(f"the target ({self.spec.factory or self.spec.step}) declares no toggles (a replay_toggles() "
                             "method) to bisect over" + ("; this answer came from the bisection saved in "
                                                         f"{self.state.path}: --fresh starts again" if self.state.resumed else ""))
        exclude = {"cudagraph"} if self.criterion == Criterion.EAGER else set()
        out, notes = candidates(declared, self.recorded_cfg, self.s.toggles, exclude)
        self.result.notes += notes
        if policy == "recorded" and self.criterion not in (Criterion.EAGER, Criterion.REPRODUCE):
            to = self.ref if self.ref is not None else 0
            if self.choices.get(to) != self.choices.get(self.rank):
                out.append(Change(TUNER_CHOICES, self.choices.get(to) or {}, "recorded", shown=f"rank {to}'s"))
        if not out:
            raise UsageError("no toggle is left to try: name toggles with --toggles, or pick another criterion")
        return out

    def start(self, changes: list[Change], flips: Callable[[list[Change]], bool]) -> list[Change] | None:
        """A set of changes that matches: all of them, or all but one (one may break the probe)."""
        if flips(changes):
            return changes
        for c in changes if len(changes) > 1 else []:
            rest = [x for x in changes if x is not c]
            if flips(rest):
                self.result.notes.append(f"with every change the step does not match; without {c.label} it does")
                return rest
        return None

    def search(self) -> None:
        base, policy = self.baseline()
        self._note_baseline(base)
        self.result.tuner_policy = policy
        if base.outcome == ProbeOutcome.MATCHES:
            self.result.status = BisectStatus.NO_DIVERGENCE
            return
        self.result.candidates = changes = self.changes(base, policy)

        def flips(subset: list[Change]) -> bool:
            return self.probe(subset, policy).outcome == ProbeOutcome.MATCHES

        start = self.start(changes, flips)
        if start is None:
            self.result.status = BisectStatus.NO_FIX
            errs = [t for t in self.tried if t.outcome == ProbeOutcome.ERROR]
            if errs:
                self.result.notes.append(f"{len(errs)} probe(s) failed, e.g. {errs[0].error}")
            return
        self.result.minimal = ddmin(start, flips)
        self.result.status = BisectStatus.DONE

    def run(self) -> ConfigBisection:
        try:
            self.search()
        except _Budget:
            self.result.status = BisectStatus.INCOMPLETE
            self.result.notes.append(f"the state is saved in {self.state.path}")
        finally:
            self.result.probes_run = self.new_probes
        if self.result.status != BisectStatus.INCOMPLETE:
            minimal = [c.label for c in self.result.minimal] if self.result.minimal else None
            self.state.data["done"] = True
            self.state.data["result"] = {"status": self.result.status, "minimal": minimal}
            self.state.save()
        return self.result


def bisect_config(
    recording: Path,
    part_name: str,
    settings: ConfigBisectSettings,
    *,
    announce: Callable[[str], None] = lambda s: None,
    on_probe: Callable[[ProbeRecord], None] = lambda p: None,
) -> ConfigBisection:
    """Find the smallest set of toggle changes that makes ``settings.step`` match (module docstring).

    ``replay.api.bisect_config`` takes a ``Part`` and fills in the rank and step."""
    return ConfigSearch(recording, part_name, settings, announce=announce, on_probe=on_probe).run()


def _module_source_digest(target: str | None) -> str | None:
    """The digest of the file of ``module:function``'s module, found without running it (its
    parent packages are imported to find it, as the factory's import would)."""
    if not target or ":" not in target:
        return None
    import importlib.util

    from replay.core.sources import source_digests

    try:
        spec = importlib.util.find_spec(target.partition(":")[0])
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    return next(iter(source_digests([origin]).values()), None) if isinstance(origin, str) else None
