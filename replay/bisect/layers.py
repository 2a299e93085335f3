"""Bisection across layers: the first module whose output differs between two executions of a step.

The two executions (``--between A,B``) are re-runs of one recorded step:

- ``eager`` / ``cudagraph``: rank R in that mode;
- ``rank:N``: rank N, from its own keyframe, inputs and collectives, in ``--mode``;
- ``recorded``: rank R in the mode the step was recorded in, with its recorded tuner choices (it
  stands for the recording, which holds no per-module outputs; the result says whether it
  reproduces the recorded digests);
- ``rerun``: rank R in ``--mode`` with the current settings: no recorded tuner choices, ``--set``
  overrides applied;
- ``run:SPEC``: a rank of another recording (``recB``, ``recB:run-000/3``, as ``replay diff``
  takes them), each re-run from its own keyframe and inputs: two runs compared module by module
  (``replay.api.bisect_runs``). The parameters whose bits differ between the two runs are named.

Each side is tapped (``replay.bisect.taps``), so module outputs are captured inside CUDA graphs
too. Outputs are paired by (module, nth call, nth tensor) and compared in the execution order
of side A. The first pair that is not bitwise equal is named with its figures and the modules
just before it; its inputs say whether the module itself computes differently (same inputs) or
received a difference made by code of its parent that runs before it.

Rows are trimmed as padding only where one side ran a padded graph batch and the other ran the
step otherwise (``_pads``); between two sides that ran alike (two ranks, two runs) a different
number of rows is a difference (an MoE expert given fewer tokens on one rank), said as such.

Rank against rank on a tensor-parallel model: modules whose parameters differ across the ranks
are shards, and their outputs differ by design until a reduction. Such an output is *rank-local*
(shown, never named first) when it is a shard's result that no collective inside the call
reduced, or when the next collective of the step runs inside an enclosing sharded call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from replay.analysis.compare import Comparison, Verdict, compare_tensors
from replay.bisect.taps import TapCapture, TapEvent, Taps
from replay.digest import digest
from replay.errors import ReplayError, UsageError
from replay.format.reader import Part
from replay.rerun.result import WeightCheck
from replay.rerun.runner import Replayer, check_weights
from replay.rerun.streams import stream_of
from replay.rerun.target import Target, TargetSpec

__all__ = ["LayersBisection", "ModuleVerdict", "Side", "SideRun", "bisect_layers", "bisect_runs", "differing_params",
           "parse_between", "recorded_mode"]

MISSING = "missing"


@dataclass(frozen=True, slots=True)
class Side:
    """One execution of the step: which rank, in which mode, with which options."""

    label: str
    rank: int
    mode: str
    options: dict[str, Any] = field(default_factory=dict)
    use_recorded_tuner: bool = True
    part: Part | None = None  # another recording's part (between two runs); None: the bisected part
    where: str = ""  # which recording, part and rank, when the two sides come from different runs
    model_from: tuple[Part, int] | None = None  # build the target this (part, rank) recorded, run on this side's data

    def of(self, default: Part) -> Part:
        return self.part if self.part is not None else default


@dataclass(slots=True)
class SideRun:
    side: Side
    capture: TapCapture
    outputs: dict[str, torch.Tensor]
    reproduces: bool | None  # the step's outputs have the rank's recorded digests; None: nothing to compare
    departed: str | None  # first fast-forward step that left the recording
    keyframe: int
    ran_as: str
    params: dict[str, "ParamSig"]
    seconds: float
    error: str | None = None  # the step raised in this re-run (and not as it did when recorded)
    weights: WeightCheck | None = None  # the rebuilt parameters against the digests of those that ran
    # The model's buffers as the step began (after the catch-up from the keyframe): a module's
    # state is no argument of it, so equal inputs do not make equal starting points.
    state: dict[str, "ParamSig"] = field(default_factory=dict)

    @property
    def weights_differ(self) -> bool:
        return self.weights is not None and not self.weights.same

    def to_json(self) -> dict[str, Any]:
        cap = self.capture
        return {
            "label": self.side.label, "rank": self.side.rank, "mode": self.side.mode, "keyframe": self.keyframe,
            "where": self.side.where or None, "weights": self.weights.to_json() if self.weights is not None else None,
            "reproduces_recording": self.reproduces, "departed": self.departed, "ran_as": self.ran_as,
            "tapped": len(cap.tapped), "fired": len(cap.fired), "events": len(cap.events),
            "graph_events": sum(1 for e in cap.events if e.source == "graph"),
            "graphs_replayed": cap.graphs_replayed, "notes": cap.notes, "seconds": round(self.seconds, 3),
            "error": self.error,
        }


@dataclass(slots=True)
class ModuleVerdict:
    name: str  # label: module, #call when called more than once, [i] for one of several outputs
    module: str
    verdict: str  # a compare Verdict's text, or "missing"
    comparison: Comparison | None = None
    inputs_equal: bool | None = None
    rank_local: bool = False
    source: str = ""  # "eager" / "graph" on side A (and B, when they differ)
    note: str = ""
    frame: int | None = None  # side A's module call this output came from
    # Leading sizes that differ between the sides and are not padding ("2 vs 1 rows"): an MoE
    # expert given fewer tokens on one side. Its output (rows) or its inputs (input_rows) differ.
    rows: str = ""
    input_rows: str = ""

    @property
    def differs(self) -> bool:
        return self.verdict != str(Verdict.BITWISE_EQUAL)

    def to_json(self) -> dict[str, Any]:
        c = self.comparison
        return {
            "name": self.name, "module": self.module, "verdict": self.verdict,
            "max_abs": c.max_abs if c else None, "max_rel": c.max_rel if c else None, "ulp": c.ulp if c else None,
            "mismatched": c.mismatched if c else None, "numel": c.numel if c else None,
            "rtol": c.rtol if c else None, "atol": c.atol if c else None, "inputs_equal": self.inputs_equal, "rank_local": self.rank_local, "source": self.source, "note": self.note,
            "rows": self.rows or None, "input_rows": self.input_rows or None,
        }

    def figures(self) -> str:
        c = self.comparison
        if c is None:
            return self.note or self.verdict
        parts = [self.verdict]
        if self.rows:  # no values compared: the shapes differ
            parts.append(self.rows)
        if self.differs:
            if c.mismatched is not None and c.numel:
                parts.append(f"{c.mismatched}/{c.numel} elements")
            if c.max_abs is not None:
                parts.append(f"max abs {c.max_abs:.3g}")
            if c.max_rel is not None:
                parts.append(f"max rel {c.max_rel:.3g}")
            if c.ulp is not None:
                parts.append(f"{c.ulp} ulp")
        return ", ".join(parts)


@dataclass(slots=True)
class LayersBisection:
    recording: str
    part: str
    step: int
    sides: list[SideRun]
    modules: list[ModuleVerdict]
    first: ModuleVerdict | None
    maker: ModuleVerdict | None  # first module whose output differs although its inputs do not
    before: list[ModuleVerdict]
    origin: str
    outputs: list[Comparison]
    silent: list[str]  # tapped modules whose forward ran on neither side
    notes: list[str] = field(default_factory=list)
    param_diffs: list[str] = field(default_factory=list)  # between two runs: parameters whose bits differ
    carried: list[str] = field(default_factory=list)  # buffers whose bits differ as the step begins (not shards)
    # Between two runs whose inputs already differ at the step: run A against run B's model on run A's data.
    equal_inputs: "LayersBisection | None" = None

    @property
    def between(self) -> list[str]:
        return [s.side.label for s in self.sides]

    def _head(self) -> str:
        sa, sb = (r.side for r in self.sides)
        if sa.where or sb.where:  # two runs: say which recording each side is
            return f"step {self.step}, {sa.label} ({sa.where}) vs {sb.label} ({sb.where}): "
        who = f"rank {sa.rank}" if sa.rank == sb.rank else f"ranks {sa.rank} and {sb.rank}"
        return f"{who}, step {self.step}, {sa.label} vs {sb.label}: "

    def _raised(self) -> SideRun | None:
        return next((s for s in self.sides if s.error), None)

    def verdict(self) -> str:
        """The first line: the module that makes the difference first, then the first that differs."""
        head = self._head()
        if self.first is None:
            return head + self._no_first() + self._weights_tail() + self._unreproduced_tail()
        n_eq = sum(1 for m in self.before_first() if not m.differs)
        first = f"first module that differs: {self.first.name} ({self.first.figures()}); {n_eq} module outputs before it are bitwise equal"
        # Lead with the module that makes the difference: the first one to differ may only pass
        # on a difference made elsewhere, or differ by rounding.
        lead = self._lead()
        line = head + (f"{lead}; {first}" if lead else first) + self._equal_inputs_tail(lead)
        own = self.maker_params()
        if own:
            line += f"; its parameters differ between the runs: {', '.join(own[:3])}{', ...' if len(own) > 3 else ''}"
        state = self.maker_state()
        if state:
            line += f"; but its state already differs when the step begins: {_names(state)}"
        raised = self._raised()
        if raised is not None:
            line += f"; {raised.side.label} raised {raised.error} in the step"
        return line + self._weights_tail() + self._unreproduced_tail()

    def _weights_tail(self) -> str:
        """A side rebuilt with other weights than it ran with (a factory that loads one checkpoint
        for both runs) does not stand for its run: said on the first line, whatever the verdict."""
        off = [r for r in self.sides if r.weights_differ]
        if not off:
            return ""
        return "; but " + "; ".join(f"{r.side.label}'s rebuilt weights are not the weights it ran with "
                                    f"({_weights_summary(r.weights)})" for r in off) + \
            ": its re-run does not stand for what it ran (check the factory)"

    def _unreproduced_tail(self) -> str:
        """A side that stands for a recorded rank whose re-run does not give that rank's recorded
        outputs: the comparison is of re-runs, not of what the ranks ran. Said on the first line
        (it was a last note under "all module outputs are bitwise equal")."""
        off = [r for r in self.sides if r.reproduces is False and _stands_for_recording(r)]
        if not off:
            return ""
        return "; but " + "; ".join(f"{r.side.label}'s re-run does not reproduce rank {r.side.rank}'s recorded outputs at this "
                                    "step" for r in off) + ": these are the re-runs' modules, not what ran (replay step says why)"

    def _swapped_maker(self) -> ModuleVerdict | None:
        """From equal inputs (run B's model on run A's data), the module that makes the difference."""
        sub = self.equal_inputs
        if sub is None or sub.problem() is not None:
            return None
        return sub.maker

    def _lead(self) -> str:
        if self.maker is not None and self.maker is not self.first:
            return f"the difference is made in {self.maker.name} ({self.maker.figures()}) from bitwise equal inputs"
        m = self._swapped_maker() if self.maker is None else None
        if m is None or self.equal_inputs is None:
            return ""
        return f"from equal inputs ({self.equal_inputs.sides[1].side.label}) the difference is made in {m.name} ({m.figures()})"

    def _equal_inputs_tail(self, lead: str) -> str:
        """When nothing makes the difference from equal inputs, say so (and why), never name one."""
        if lead or self.maker is not None or self.first is None or self.first.inputs_equal is not False:
            return ""
        sub = self.equal_inputs
        if sub is not None and sub.problem() is not None:
            return f"; no module could be compared from equal inputs ({sub.problem()})"
        if sub is not None and sub.first is None:
            return (f"; with equal inputs ({sub.sides[1].side.label}) no module output differs: the difference comes in "
                    "with the inputs or state the runs carry into this step")
        if sub is not None:
            kf = sub.sides[1].keyframe
            return (f"; no module turns bitwise equal inputs into different outputs, not even with {sub.sides[1].side.label}: "
                    f"its catch-up from the keyframe at step {kf} already changed the state (bisect the first step where "
                    "the runs differ)")
        return "; no module turns bitwise equal inputs into different outputs (the difference comes in with its inputs)"

    def _no_first(self) -> str:
        """The verdict when no replicated module output differs: never "equal" unless compared."""
        compared = [m for m in self.modules if not m.rank_local]
        raised = self._raised()
        if raised is not None:
            return (f"{raised.side.label} raised {raised.error} in the step; none of the {len(compared)} module "
                    "outputs compared before that differs, nothing after it was compared")
        if not compared:
            return "no module output could be compared (no tap fired on both sides)"
        local = [m for m in self.modules if m.rank_local and m.differs]
        if local:
            # Never "nothing differs" over a table that shows a difference: say what differs.
            eq = next((m for m in local if m.inputs_equal), local[0])
            return (f"no replicated module output differs; {len(local)} rank-local (shard) outputs differ, as "
                    f"shards do, the first from {'equal' if eq.inputs_equal else 'different'} inputs: {eq.name} "
                    f"({eq.figures()}); if {eq.module} is not sharded, it makes the difference")
        if any(not c.equal for c in self.outputs):
            return f"the step's outputs differ but none of the {len(compared)} tapped module outputs does"
        if not self.outputs:
            return f"all {len(compared)} module outputs are bitwise equal; the step returned no output to compare"
        return f"all {len(compared)} module outputs are bitwise equal"

    def maker_params(self) -> list[str]:
        """Parameters of the module that makes the difference whose bits differ between the two runs."""
        m = self.maker or self._swapped_maker()
        return _under(m.module, self.param_diffs) if m is not None else []

    def maker_state(self) -> list[str]:
        """Buffers of the module that makes the difference whose bits already differ as the step
        begins: the module's code then only carries a difference in, it does not make it."""
        m = self.maker
        return _under(m.module, self.carried) if m is not None else []

    def problem(self) -> str | None:
        """Why the two executions could not both be compared in full; None if they were."""
        raised = self._raised()
        if raised is not None:
            return f"{raised.side.label}: step {self.step} raised {raised.error}"
        if not [m for m in self.modules if not m.rank_local] and not self.outputs:
            return f"step {self.step}: nothing was compared (no tap fired and no output on both sides)"
        return None

    def before_first(self) -> list[ModuleVerdict]:
        if self.first is None:
            return []
        i = self.modules.index(self.first)
        return [m for m in self.modules[:i] if not m.rank_local]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "bisect-layers",
            "recording": self.recording,
            "part": self.part,
            "rank": self.sides[0].side.rank,
            "ranks": [s.side.rank for s in self.sides],
            "step": self.step,
            "between": self.between,
            "first": self.first.name if self.first else None,
            "first_module": self.first.module if self.first else None,
            "maker": self.maker.name if self.maker else None,
            "before": [m.name for m in self.before],
            "origin": self.origin,
            "modules": [m.to_json() for m in self.modules],
            "outputs": [c.to_json() for c in self.outputs],
            "silent": self.silent,
            "sides": [s.to_json() for s in self.sides],
            "notes": self.notes,
            "parameters_differ": self.param_diffs,
            "state_differs": self.carried,
            "equal_inputs": self.equal_inputs.to_json() if self.equal_inputs is not None else None,
        }


def recorded_mode(part: Part, rank: int, step: int) -> str:
    """The re-run mode that matches how the step ran when recorded."""
    return "cudagraph" if part[rank].step(step).mode == "graph" else "eager"


def parse_between(text: str, *, rank: int | None, mode: str | None, recorded: Callable[[int], str],
                  options: dict[str, Any] | None = None) -> tuple[Side, Side]:
    """``eager,cudagraph`` | ``rank:0,rank:3`` | ``recorded,rerun`` (and mixes) as two Sides."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if len(items) != 2:
        raise UsageError(f"--between {text!r}: name two executions, e.g. eager,cudagraph or rank:0,rank:3 or recorded,rerun")
    opts = dict(options or {})
    sides = []
    for item in items:
        if item.startswith("run:"):
            raise UsageError(f"--between {text}: two runs (run:A,run:B) are bisected by replay.api.bisect_runs")
        if item.startswith("rank:"):
            try:
                r = int(item.partition(":")[2])
            except ValueError:
                raise UsageError(f"--between: {item!r} is not rank:N") from None
            sides.append(Side(f"rank {r}", r, mode or "eager", opts))
            continue
        if rank is None:
            raise UsageError(f"--between {text}: give --rank R, the rank whose step to re-run as {item}")
        if item in ("eager", "cudagraph"):
            sides.append(Side(item, rank, item, opts))
        elif item == "recorded":
            sides.append(Side("recorded", rank, recorded(rank), {}, use_recorded_tuner=True))
        elif item == "rerun":
            # The current settings: tuner choices are the target's own, not the recorded winners.
            sides.append(Side("rerun", rank, mode or "eager", {"tuner_choices": {}, **opts}, use_recorded_tuner=False))
        else:
            raise UsageError(f"--between: unknown execution {item!r}; use eager, cudagraph, rank:N, recorded or rerun")
    if sides[0] == sides[1]:
        raise UsageError(f"--between {text}: the two executions are the same")
    return sides[0], sides[1]


def _run_side(part: Part, side: Side, step: int, *, patterns: list[str] | None, device: str, factory: str | None,
              want_params: bool, progress: Callable[..., Iterable[int]]) -> SideRun:
    t0 = time.perf_counter()
    spec = None
    if side.model_from is not None:  # another run's model (target, config, weights) on this part's data
        mp, mr = side.model_from
        spec = TargetSpec.from_rank_file(mp[mr], stream_of(mp[mr], step))
    # step=: several models in one loop (draft and target): the model that holds this step is rebuilt.
    rp = Replayer(part, side.rank, mode=side.mode, device=device, factory=factory, options=side.options,
                  use_recorded_tuner=side.use_recorded_tuner, spec=spec, step=step if spec is None else None)
    kf, _ = rp.keyframe_for(step)
    rp.check(kf, step)
    rc = rp.collectives
    # One rank alone: the recorded collectives count the step's collectives (stand-ins cannot be
    # wrapped from here: they are installed after the taps).
    taps = Taps(patterns, collectives=(lambda: rc._index) if rc is not None else None)

    def install(t: Target) -> None:
        taps.install(t)

    try:
        target = rp.build(install=install)
        weights = check_weights(target)
        departed = rp.goto(step, progress=progress)
        model = target.module()
        state = _buffer_digests(model) if want_params and model is not None else {}
        taps.arm()
        try:
            outs = rp.run(step)
        finally:
            capture = taps.disarm()
        params: dict[str, ParamSig] = {}
        if want_params and model is not None:
            params = _param_digests(model)
        reproduces: bool | None = rp.departure(step, outs) is None
        if reproduces and not rp.compared(step, outs) and rp.last_error is None:
            reproduces = None  # nothing recorded to compare with: neither reproduced nor not
        view = part[side.rank].step(step)
        error = rp.last_error
        if error is not None and not view.ok and error.split(":")[0] == view.reason.split(":")[0]:
            error = None  # raised as it did when recorded
        info = getattr(target.obj, "last_run_info", None)
        ran_as = ""
        if isinstance(info, dict):
            ran_as = f"{info.get('mode', '')} {info.get('key', '')}".strip()
        if rp.last_error:
            capture.notes.append(f"the step raised: {rp.last_error}")
    finally:
        # The Replayer first (it restores torch.distributed), then the taps' own patches.
        rp.close()
        taps.close()
    return SideRun(side=side, capture=capture, outputs=outs, reproduces=reproduces,
                   departed=str(departed) if departed else None, keyframe=kf, ran_as=ran_as or side.mode,
                   params=params, seconds=time.perf_counter() - t0, error=error, weights=weights, state=state)


NO_PADDING = (False, False)


def _ran_padded(r: SideRun) -> bool:
    """Whether a side ran the step as a graph, whose batch is padded up to its bucket: the
    target says so (``last_run_info``: "graph bs4"), or it says nothing (``ran_as`` is then the
    mode) and the side was run in cudagraph mode, or a tap fired inside a captured graph."""
    return r.ran_as.startswith(("graph", "cudagraph")) or any(e.source == "graph" for e in r.capture.events)


def _pads(ra: SideRun, rb: SideRun) -> tuple[bool, bool]:
    """Which side's extra leading rows may be padding (``_align``).

    Padding is a difference in how the step ran, not in what it computed: a graph runs its batch
    padded to a bucket (3 requests in 4 rows), eager the real batch. So only a side that ran a
    padded graph, against a side that ran the step otherwise (eager, another bucket), may pad.
    Two sides that ran alike (two ranks, two runs, eager against eager, one bucket on both) run
    the rows they were given: a different number of rows is then a difference of the step (an
    MoE expert given 2 tokens on one rank and 1 on the other), which trimming would hide, the
    extra row being the very token the other side dropped. The extra rows' values cannot tell:
    a graph's padded rows may hold stale data, not zeros (bug_stale_padding)."""
    if ra.ran_as == rb.ran_as:
        return NO_PADDING
    return _ran_padded(ra), _ran_padded(rb)


def _row_counts(a: torch.Tensor, b: torch.Tensor) -> str:
    """``"2 vs 1 rows"`` when the two tensors differ in their leading size only; else ``""``."""
    if a.shape != b.shape and a.dim() == b.dim() and a.dim() >= 1 and a.shape[1:] == b.shape[1:]:
        return f"{a.shape[0]} vs {b.shape[0]} rows"
    return ""


def _align(a: torch.Tensor, b: torch.Tensor, pads: tuple[bool, bool]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Trim padded rows: a graph runs a padded batch, eager the real one (same leading rows).

    Only rows of a side that may pad (``pads``, from ``_pads``) are trimmed, and only when that
    side has the more rows; otherwise the tensors are returned whole, and their shapes differ."""
    if not _row_counts(a, b) or not pads[0 if a.shape[0] > b.shape[0] else 1]:
        return a, b, ""
    n = min(a.shape[0], b.shape[0])
    return a[:n], b[:n], f"first {n} rows compared ({a.shape[0]} vs {b.shape[0]}: the rest is padding)"


def _compare_inputs(a: list[torch.Tensor], b: list[torch.Tensor], pads: tuple[bool, bool]) -> tuple[bool | None, str]:
    """Whether the inputs are bitwise equal (after trimming padding), and the first pair that
    differs in its number of rows ("2 vs 1 rows"): inputs of other shapes are never equal."""
    if len(a) != len(b):
        return None, ""
    for x, y in zip(a, b):
        x, y, _ = _align(x, y, pads)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, _row_counts(x, y)
        if not torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)):
            return False, ""
    return True, ""


@dataclass(frozen=True, slots=True)
class ParamSig:
    """What tells a shard from a replicated weight across two ranks: bits, shape, a sample of values."""

    digest: int
    shape: tuple[int, ...]
    sample: torch.Tensor  # up to SAMPLE leading elements, float64 on the CPU
    declared_shard: bool | None = None  # a DTensor says (Shard placement); None: plain tensor


SAMPLE = 4096
# Two plain-tensor shards of one weight are different slices: their values are unrelated. A
# replicated weight that differs on one rank (a bug, a rounding, a perturbation) is close to the
# other rank's. Mean relative difference above this: unrelated values, a shard.
SHARD_REL_DIFF = 0.05


def _param_digests(model: torch.nn.Module) -> dict[str, ParamSig]:
    """Signatures of the parameters, by which ranks' shards are told apart (``_sharded``).

    A model sharded with DTensor says which parameters are shards: those placed ``Shard``; its
    other parameters are replicated by construction. Plain tensors say nothing: ``_sharded``
    tells a shard by shape and values."""
    return {n: _signature(p) for n, p in model.named_parameters()}


def _buffer_digests(model: torch.nn.Module) -> dict[str, ParamSig]:
    """Signatures of the model's buffers now (a KV cache, a running scale): its state."""
    return {n: _signature(b) for n, b in model.named_buffers() if isinstance(b, torch.Tensor) and not b.is_meta}


def _signature(t: torch.Tensor) -> ParamSig:
    """A tensor's bits, shape and leading values (this rank's shard of a DTensor, which says
    whether it is one)."""
    placements = getattr(t, "placements", None)
    declared = None if placements is None else any(pl.is_shard() for pl in placements)
    t = t.detach()
    local = t.to_local() if callable(getattr(t, "to_local", None)) else t
    flat = local.reshape(-1)[:SAMPLE].to("cpu", torch.float64) if local.is_floating_point() else torch.zeros(0, dtype=torch.float64)
    return ParamSig(digest=digest(local), shape=tuple(local.shape), sample=flat, declared_shard=declared)


def _carried_state(ra: SideRun, rb: SideRun) -> list[str]:
    """Buffers whose bits differ between the two sides as the step begins. Across ranks of one
    run whose step reduces with collectives, a buffer of a module holding a shard (a KV cache of
    the rank's own heads) differs by design and is left out."""
    a, b = ra.state, rb.state
    differ = sorted(n for n in a.keys() & b.keys() if a[n].digest != b[n].digest)
    if ra.side.part is None and rb.side.part is None and ra.side.rank != rb.side.rank and _made_collectives(ra):
        sharded = _sharded(ra.params, rb.params)

        def of_a_shard(name: str) -> bool:
            owner = name.rpartition(".")[0]
            return any(p.startswith(owner + ".") if owner else True for p in sharded)

        differ = [n for n in differ if a[n].shape == b[n].shape and not of_a_shard(n)]
    return differ


def _under(module: str, names: list[str]) -> list[str]:
    prefix = module + "." if module else ""
    return [n for n in names if n.startswith(prefix)]


def _names(names: list[str]) -> str:
    kind = "buffer" if len(names) == 1 else "buffers"
    return f"{kind} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def _is_shard(x: ParamSig, y: ParamSig) -> bool:
    """Whether two ranks' differing values of one parameter are shards (not a replicated weight
    that differs): declared so (DTensor), of other shapes, or with unrelated values."""
    if x.declared_shard is not None or y.declared_shard is not None:
        return bool(x.declared_shard or y.declared_shard)
    if x.shape != y.shape or x.sample.numel() == 0:
        return True
    diff = (x.sample - y.sample).abs()
    scale = torch.maximum(x.sample.abs(), y.sample.abs()).clamp_min(1e-30)
    return float((diff / scale).mean()) > SHARD_REL_DIFF


def _made_collectives(run: SideRun) -> bool:
    return run.capture.collectives > 0 or any(f.coll_exit > 0 for e in run.capture.events for f in e.frames.values())


def _sig(p: "ParamSig | int") -> ParamSig:
    """A bare digest (all a caller may know) as a signature that says nothing but the bits."""
    return p if isinstance(p, ParamSig) else ParamSig(digest=int(p), shape=(), sample=torch.zeros(0, dtype=torch.float64))


def _sharded(a: dict[str, "ParamSig | int"], b: dict[str, "ParamSig | int"]) -> set[str]:
    """Parameters that are shards: present on one rank only, or differing as shards do."""
    out = set()
    for n in a.keys() | b.keys():
        x, y = a.get(n), b.get(n)
        if x is None or y is None:
            out.add(n)
        elif _sig(x).digest != _sig(y).digest and _is_shard(_sig(x), _sig(y)):
            out.add(n)
    return out


def replicated_differing(a: dict[str, "ParamSig | int"], b: dict[str, "ParamSig | int"]) -> list[str]:
    """Replicated parameters whose bits differ across the two ranks (a rank's weights differ)."""
    return sorted(n for n in a.keys() & b.keys()
                  if _sig(a[n]).digest != _sig(b[n]).digest and not _is_shard(_sig(a[n]), _sig(b[n])))


def differing_params(a: dict[str, "ParamSig | int"], b: dict[str, "ParamSig | int"]) -> list[str]:
    """Between two runs of one model: parameters on one side only, or whose bits differ."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or _sig(a[n]).digest != _sig(b[n]).digest)


def _rank_local(e: TapEvent, sharded_params: set[str]) -> bool:
    """Whether ``e`` is a shard's partial result (see the module docstring)."""

    def sharded(module: str) -> bool:
        prefix = module + "." if module else ""
        return any(p.startswith(prefix) for p in sharded_params)

    own = e.frames.get(e.frame)
    if own is None:
        return False
    if sharded(e.module) and own.coll_exit == own.coll_enter:
        return True
    k = own.coll_exit  # index of the next collective of the unit, if one runs after this output
    holders = [f for f in e.frames.values() if f.coll_enter <= k < f.coll_exit]
    if not holders:
        return False
    innermost = max(holders, key=lambda f: f.id)  # entered last: the deepest call active at it
    return any(f.id == innermost.id for f in e.ancestors()) and sharded(innermost.module)


def compare_captures(a: SideRun, b: SideRun) -> list[ModuleVerdict]:
    """Pair the two sides' module outputs and compare them, in side A's execution order."""
    # Without a collective in the step nothing is reduced, so nothing is a shard: parameters that
    # differ across ranks are then a difference (a replicated model with one rank perturbed).
    sharded = _sharded(a.params, b.params) if a.side.rank != b.side.rank and _made_collectives(a) else set()
    pads = _pads(a, b)
    others: dict[tuple[str, int, int], TapEvent] = {e.key: e for e in b.capture.events}
    rows: list[ModuleVerdict] = []
    for e in a.capture.events:
        o = others.pop(e.key, None)
        local = bool(sharded) and (_rank_local(e, sharded) or (o is not None and _rank_local(o, sharded)))
        if o is None:
            rows.append(ModuleVerdict(e.label, e.module, MISSING, source=e.source, rank_local=local, frame=e.frame,
                                      note=f"no output on {b.side.label}: its tap never fired there"))
            continue
        rows.append(_pair(e, o, a.side, b.side, pads, local))
    for o in b.capture.events:
        if o.key in others:
            rows.append(ModuleVerdict(o.label, o.module, MISSING, source=o.source,
                                      note=f"no output on {a.side.label}: its tap never fired there"))
    return rows


def _pair(e: TapEvent, o: TapEvent, a: Side, b: Side, pads: tuple[bool, bool], local: bool) -> ModuleVerdict:
    """One module output of side A against side B's, with whether its inputs are equal."""
    x, y, note = _align(e.output, o.output, pads)
    c = compare_tensors(x, y, name_a=a.label, name_b=b.label)
    rows = _row_counts(x, y)  # left whole by _align: not padding
    inputs_equal, input_rows = _compare_inputs(e.inputs, o.inputs, pads)
    if rows or input_rows:
        note = f"{rows or input_rows}{'' if rows else ' in its inputs'} on {a.label} and {b.label}: a difference, not padding"
    src = e.source if e.source == o.source else f"{e.source}/{o.source}"
    if local:
        note = "; ".join(filter(None, [note, "rank-local: a shard's result before its reduction"]))
    return ModuleVerdict(e.label, e.module, str(c.verdict), c, inputs_equal, local, src, note, e.frame, rows, input_rows)


def _encloses(outer: ModuleVerdict, inner: ModuleVerdict, run: SideRun) -> bool:
    """Whether ``inner``'s call ran inside ``outer``'s (side A's frames)."""
    if outer.frame is None or inner.frame is None:
        return False
    ev = next((e for e in run.capture.events if e.frame == inner.frame), None)
    return ev is not None and any(f.id == outer.frame for f in ev.ancestors())


def _origin(first: ModuleVerdict | None, rows: list[ModuleVerdict], a: SideRun) -> str:
    """Where the first difference is made: inside the module, in a parent's code, or before."""
    if first is None:
        return ""
    if first.verdict == MISSING:
        return f"{first.name} ran on one side only: the two executions take different code paths there"
    if first.inputs_equal:
        returns = f"returns {first.rows}" if first.rows else "returns different outputs"
        return f"{first.name} receives bitwise equal inputs on both sides and {returns}: the difference is made inside it"
    if first.inputs_equal is None:
        return ""
    by_frame = {m.frame: m for m in rows if m.frame is not None}
    ev = next((e for e in a.capture.events if e.frame == first.frame), None)
    outer = first.name
    for parent in ev.ancestors() if ev is not None else []:
        row = by_frame.get(parent.id)
        if row is None or row.inputs_equal is None:
            continue
        if row.inputs_equal:
            return _made_by_parent(first, row)
        outer = row.name
    return (f"{outer} already receives different inputs when it is called: the difference comes from outside the tapped "
            f"modules (the step's inputs, state carried over from earlier steps, or code outside the model)")


def _made_by_parent(first: ModuleVerdict, parent: ModuleVerdict) -> str:
    """``first``'s inputs differ, ``parent`` (enclosing it) gets equal ones: its own code makes the difference."""
    if first.input_rows:
        # A different number of rows (an MoE's routing and capacity give an expert more tokens on
        # one side): the values of the rows both sides have may agree, the inputs still differ.
        return (f"{first.name} receives a different number of rows on the two sides ({first.input_rows}, not padding): "
                f"the difference is made in {parent.name}, whose inputs are bitwise equal "
                f"and whose own code (outside any tapped module, such as routing or capacity) sends {first.name} "
                "a different number of rows")
    return (f"{first.name} already receives different inputs and no tapped module before it differs: the difference "
            f"is made by code of {parent.name} that runs before it (outside any tapped module)")


def bisect_layers(
    part: Part,
    step: int,
    a: Side,
    b: Side,
    *,
    modules: list[str] | None = None,
    device: str = "cpu",
    factory: str | None = None,
    context: int = 3,
    recording: str = "",
    progress: Callable[..., Iterable[int]] = lambda it, label="": it,
) -> LayersBisection:
    """Re-run ``step`` as ``a`` and as ``b`` with taps on every module; name the first that differs.

    A side with its own ``part`` (another recording) is re-run from that part's data."""
    for s in (a, b):
        s.of(part)[s.rank].step(step)
    want_params = a.rank != b.rank or a.part is not None or b.part is not None
    ra, rb = (_run_side(s.of(part), s, step, patterns=modules, device=device, factory=factory, want_params=want_params,
                        progress=progress) for s in (a, b))
    return _bisection(part, step, ra, rb, context=context, recording=recording)


def _bisection(part: Part, step: int, ra: SideRun, rb: SideRun, *, context: int, recording: str) -> LayersBisection:
    """Compare two sides' module outputs and name what differs."""
    across_runs = ra.side.part is not None or rb.side.part is not None
    rows = compare_captures(ra, rb)
    first = next((m for m in rows if m.differs and not m.rank_local), None)
    makers = [m for m in rows if m.differs and not m.rank_local and m.inputs_equal]
    maker = _maker(makers, ra)
    param_diffs = differing_params(ra.params, rb.params) if across_runs else []
    carried = _carried_state(ra, rb)
    notes = [n for r in (ra, rb) for n in _side_notes(r, step)] + _rounding_notes(rows, makers, maker)
    notes += _param_notes(ra, rb, param_diffs) + _state_notes(ra, rb, carried, maker) + _row_notes(rows, ra, rb)
    origin = _origin(first, rows, ra)
    state = _under(first.module, carried) if first is not None and first.inputs_equal else []
    if state:
        origin = (f"{first.name} receives bitwise equal inputs on both sides, but its state already differs when the step "  # type: ignore[union-attr]
                  f"begins ({_names(state)}: set before this step, by an earlier step or before the recording began, "
                  "as by a prefill): the difference is carried in with that state, not made by its code in this step")
    return LayersBisection(recording=recording, part=part.name, step=step, sides=[ra, rb], modules=rows, first=first,
                           maker=maker, before=_before(rows, first, context), origin=origin,
                           outputs=_outputs(ra, rb), silent=_silent(ra, rb), notes=notes, param_diffs=param_diffs,
                           carried=carried)


def bisect_runs(
    step: int,
    a: Side,
    b: Side,
    *,
    modules: list[str] | None = None,
    device: str = "cpu",
    factory: str | None = None,
    context: int = 3,
    recording: str = "",
    progress: Callable[..., Iterable[int]] = lambda it, label="": it,
) -> LayersBisection:
    """Two runs (``a`` and ``b`` each name their ``part``), module by module, at ``step``.

    When no module turns equal inputs into different outputs (the step's inputs or the state
    carried over already differ between the runs), ``b``'s model is also run on ``a``'s data
    (keyframe, inputs, recorded collectives): every input is then equal, and the module that
    differs first is the one whose code, config or weights make the difference
    (``LayersBisection.equal_inputs``)."""
    assert a.part is not None and b.part is not None
    kw: dict[str, Any] = dict(patterns=modules, device=device, factory=factory, want_params=True, progress=progress)
    for s in (a, b):
        s.of(a.part)[s.rank].step(step)
    ra = _run_side(a.part, a, step, **kw)
    rb = _run_side(b.part, b, step, **kw)
    result = _bisection(a.part, step, ra, rb, context=context, recording=recording)
    if result.first is None or result.maker is not None or result.problem() is not None:
        return result
    swapped = Side(f"{b.label}'s model on {a.label}'s data", a.rank, b.mode, dict(b.options), part=a.part,
                   where=f"the model of {b.where} on the data of {a.where}", model_from=(b.part, b.rank))
    try:
        rs = _run_side(a.part, swapped, step, **kw)
    except ReplayError as e:
        result.notes.append(f"{swapped.label}: could not be run ({e}), so no module was compared from equal inputs")
        return result
    result.equal_inputs = _bisection(a.part, step, ra, rs, context=context, recording=recording)
    return result


def _before(rows: list[ModuleVerdict], first: ModuleVerdict | None, context: int) -> list[ModuleVerdict]:
    """The ``context`` replicated module outputs just before the first that differs."""
    if first is None or context <= 0:
        return []
    return [m for m in rows[:rows.index(first)] if not m.rank_local][-context:]


def _outputs(ra: SideRun, rb: SideRun) -> list[Comparison]:
    """The step's own outputs, compared by name."""
    a, b = ra.side.label, rb.side.label
    pads = _pads(ra, rb)
    return [compare_tensors(*_align(ra.outputs[k], rb.outputs[k], pads)[:2], name_a=f"{a} {k}", name_b=f"{b} {k}")
            for k in ra.outputs if k in rb.outputs]


def _silent(ra: SideRun, rb: SideRun) -> list[str]:
    """Tapped modules whose forward ran on neither side."""
    return [m for m in ra.capture.tapped if m not in ra.capture.called and m not in rb.capture.called]


def _maker(makers: list[ModuleVerdict], ra: SideRun) -> ModuleVerdict | None:
    """The module that makes the difference, among those that turn equal inputs into outputs that differ.

    One whose outputs differ only within tolerance is rounding (a GEMM whose blocking depends on
    the batch size, say a padded graph batch against the eager one): the module that makes the
    real difference is the first that turns equal inputs into outputs beyond tolerance. A parent
    whose child already makes a difference only passes it on."""
    inner = [m for m in makers if not any(_encloses(m, c, ra) for c in makers if c is not m)]
    return next((m for m in inner if m.verdict == str(Verdict.DIFFERENT)), makers[0] if makers else None)


def _stands_for_recording(r: SideRun) -> bool:
    """A side re-run as recorded (a rank, a run), not one given other settings on purpose."""
    return r.side.label not in ("rerun", "eager", "cudagraph") and r.side.model_from is None


def _side_notes(r: SideRun, step: int) -> list[str]:
    """What the re-run of one side says about itself: reproduced or not, departed, taps."""
    label = r.side.label
    notes: list[str] = []
    if r.reproduces is None:
        notes.append(f"{label}: step {step} has no recorded output to compare this re-run with")
    elif not r.reproduces:
        expected = not _stands_for_recording(r)
        notes.append(f"{label}: the re-run of step {step} does not reproduce rank {r.side.rank}'s recorded outputs"
                     + (" (as expected: it runs with other settings than recorded)" if expected else ""))
    if r.departed:
        notes.append(f"{label}: the fast-forward from the keyframe at step {r.keyframe} departed from the recording at {r.departed}")
    notes += [f"{label}: {n}" for n in r.capture.notes]
    if not r.capture.events:
        notes.append(f"{label}: no tap fired at all in step {step}")
    return notes


def _rounding_notes(rows: list[ModuleVerdict], makers: list[ModuleVerdict], maker: ModuleVerdict | None) -> list[str]:
    end = rows.index(maker) if maker else len(rows)
    rounding = [m for m in makers if m is not maker and rows.index(m) < end]
    if not rounding:
        return []
    c = rounding[0].comparison
    tol = c.verdict_text[len(str(Verdict.WITHIN_TOLERANCE)):] if c is not None else ""
    return [f"{rounding[0].name} already turns equal inputs into outputs that differ within tolerance{tol} "
            f"({rounding[0].figures()}): rounding, not the difference {maker.name if maker else 'that matters'} makes"]


def _param_notes(ra: SideRun, rb: SideRun, param_diffs: list[str]) -> list[str]:
    a, b = ra.side, rb.side
    if param_diffs:
        return [f"{len(param_diffs)} parameter(s) differ between {a.label} and {b.label}: {', '.join(param_diffs[:6])}"
                + (", ..." if len(param_diffs) > 6 else "")]
    if a.part is not None or b.part is not None:
        if not ra.params:
            return []
        rebuilt = " as rebuilt, not as recorded" if ra.weights_differ or rb.weights_differ else ""
        return [f"every parameter has the same bits in {a.label} and {b.label}{rebuilt} ({len(ra.params)} compared)"]
    if a.rank == b.rank:
        return []
    odd = replicated_differing(ra.params, rb.params)
    if not odd:
        return []
    return [f"{len(odd)} replicated parameter(s) differ across ranks {a.rank} and {b.rank} "
            f"(same shape, close values: not shards): {', '.join(odd[:6])}"]


def _state_notes(ra: SideRun, rb: SideRun, carried: list[str], maker: ModuleVerdict | None) -> list[str]:
    """Buffers that differ as the step begins and are not the maker's own (said on the first line)."""
    mine = set(_under(maker.module, carried)) if maker is not None else set()
    rest = [n for n in carried if n not in mine]
    if not rest:
        return []
    return [f"{len(rest)} buffer(s) already differ between {ra.side.label} and {rb.side.label} when the step begins "
            f"(state set before it): {', '.join(rest[:6])}" + (", ..." if len(rest) > 6 else "")]


def _row_notes(rows: list[ModuleVerdict], ra: SideRun, rb: SideRun) -> list[str]:
    notes = _count_notes(rows, ra, rb)
    only = {m.module for m in rows if m.verdict == MISSING}
    if only:
        notes.append(f"{len(only)} module(s) have outputs on one side only: their taps never fired on the other ({', '.join(sorted(only)[:5])})")
    local = sum(1 for m in rows if m.rank_local)
    if local:
        notes.append(f"{local} outputs are rank-local (shards of a tensor-parallel model before their reduction): shown, not named first")
    return notes


def _count_notes(rows: list[ModuleVerdict], ra: SideRun, rb: SideRun) -> list[str]:
    """Outputs compared on their first rows only (padding), or whose rows differ in number: said
    in the text, not only in each module's note of the JSON."""
    notes = []
    padded = [m for m in rows if "the rest is padding" in m.note]
    if padded:
        notes.append(f"{len(padded)} module output(s) compared on their first rows only, the rest being a graph's padding "
                     f"({ra.side.label} ran {ra.ran_as}, {rb.side.label} ran {rb.ran_as}), as {padded[0].name}: {padded[0].note}")
    counted = [m for m in rows if m.rows or m.input_rows]
    if counted:
        m = counted[0]
        what = f"returns {m.rows}" if m.rows else f"receives {m.input_rows}"
        why = (f"both ran {ra.ran_as}" if ra.ran_as == rb.ran_as else
               f"{ra.side.label} ran {ra.ran_as}, {rb.side.label} ran {rb.ran_as}, and the side with more rows ran no padded graph")
        notes.append(f"{len(counted)} module(s) see a different number of rows on {ra.side.label} and {rb.side.label}, "
                     f"first {m.name}, which {what}: compared as different, not trimmed as padding ({why})")
    return notes


def _weights_summary(w: WeightCheck | None) -> str:
    if w is None:
        return ""
    parts = [f"{len(names)} {what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
             for what, names in (("differ", w.differ), ("missing", w.missing), ("not recorded", w.extra)) if names]
    return "; ".join(parts)

