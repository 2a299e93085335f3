"""Taps on module outputs that keep working inside CUDA graphs.

A forward hook is Python: it runs while a graph is captured and never again when the graph is
replayed, so a hook-based tap silently stops reporting exactly where graph hazards live. These
taps instead wrap each module's ``forward`` before any graph is captured (``install`` is meant
for ``Replayer.build(install=...)``). Eagerly, a wrapper copies the module's output (and inputs)
when it returns. Under capture it makes the same copy into a buffer of the graph's own pool, so
the copy kernel becomes part of the graph; ``CUDAGraph.replay`` is wrapped to snapshot those
buffers (on the device, in stream order, with no host sync) each time that graph replays.
A module that ran eagerly on one side and has no output on the other, eager or captured, is
reported as a tap that never fired, never silently dropped.

Every module call is also framed (which call encloses which, how many collectives had run when
it started and ended), so a rank-against-rank comparison of a tensor-parallel model can tell a
shard's partial result, which differs across ranks by design, from a replicated one.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from replay.digest import local_tensor
from replay.errors import UsageError
from replay.rerun.target import Target

__all__ = ["Frame", "TapCapture", "TapEvent", "Taps", "flatten_tensors"]


@dataclass(slots=True)
class Frame:
    """One call of one module: where it sits among the calls and collectives of its unit."""

    id: int
    module: str
    parent: int | None
    coll_enter: int  # collectives made in this unit (step or capture) before the call started
    coll_exit: int = -1  # ... and before it returned


@dataclass(slots=True)
class TapEvent:
    """One tensor a module returned, in one execution of one step."""

    module: str
    index: int  # position of the tensor in the module's (flattened) output
    n_out: int
    output: torch.Tensor
    inputs: list[torch.Tensor]
    source: str  # "eager": copied as it ran; "graph": copied inside a captured graph
    frame: int
    frames: dict[int, Frame]  # every call of the unit this event belongs to, by id
    call: int = 0  # nth call of ``module`` in the step; set when the step's events are collected

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.module, self.call, self.index)

    @property
    def label(self) -> str:
        return self.module + (f"#{self.call}" if self.call else "") + (f"[{self.index}]" if self.n_out > 1 else "")

    def ancestors(self) -> list[Frame]:
        """The calls enclosing this one, innermost first."""
        out = []
        f = self.frames.get(self.frame)
        while f is not None and f.parent is not None:
            f = self.frames.get(f.parent)  # None past the unit (a capture made inside a call)
            if f is not None:
                out.append(f)
        return out


@dataclass(slots=True)
class TapCapture:
    """What the taps saw during one armed step (tensors on the CPU)."""

    events: list[TapEvent]
    tapped: list[str]  # modules a tap was put on
    called: set[str]  # modules whose forward ran (eagerly or inside a replayed graph)
    graphs_replayed: int = 0
    notes: list[str] = field(default_factory=list)
    # Collectives the step made, inside a tapped module or not (an all_gather of the logits'
    # shards in the step's own code, after the head): what tells a shard's result apart.
    collectives: int = 0

    @property
    def fired(self) -> set[str]:
        return {e.module for e in self.events}


def flatten_tensors(obj: Any, _depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a (nested) output or argument structure, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if _depth > 4:
        return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flatten_tensors(v, _depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flatten_tensors(v, _depth + 1)]
    return []


def _restorer(owner: Any, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(owner, name, value)


def _copy(t: torch.Tensor) -> torch.Tensor:
    # A DTensor by its local shard: copying a Partial one whole would run a collective.
    return local_tensor(t).detach().clone()


class Taps:
    """Output taps on the modules of a target whose names match ``patterns`` (all when None).

    Usage with a Replayer::

        taps = Taps(["layers.*"], collectives=lambda: rp.collectives._index)
        rp.build(install=taps.install)
        rp.goto(step)
        taps.arm(); rp.run(step); seen = taps.disarm()
        rp.close(); taps.close()

    ``collectives`` counts the collectives made so far in the step (a one-rank replay's
    recorded collectives know it); without it the taps count calls into torch.distributed.
    """

    def __init__(
        self,
        patterns: list[str] | None = None,
        *,
        inputs: bool = True,
        root: bool = False,
        collectives: Callable[[], int] | None = None,
    ) -> None:
        self.patterns = [p for p in (patterns or []) if p]
        self.inputs = inputs
        self.root = root
        self._count = collectives
        self._own_count = 0
        self._undo: list[Callable[[], None]] = []
        self._ids = itertools.count()
        self._stack: list[Frame] = []
        self._unit: dict[int, Frame] = {}  # frames of the current unit (the step, or a capture)
        self._armed = False
        self._events: list[TapEvent] = []
        self._called: set[str] = set()
        self._notes: list[str] = []
        self._capturing: list[torch.cuda.CUDAGraph] = []
        self._saved_unit: dict[int, Frame] | None = None
        self._graphs: dict[int, tuple[Any, list[TapEvent], set[str]]] = {}  # id(graph) -> (graph, events, called)
        self._replays = 0
        self._cuda = torch.cuda.is_available()
        self.tapped: list[str] = []

    # -- installing ----------------------------------------------------------------------------

    def matches(self, name: str) -> bool:
        if name == "":
            return self.root or "" in self.patterns
        return not self.patterns or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def install(self, target: Target) -> Callable[[], None]:
        """Wrap every module's forward (taps on the matching ones); returns ``close``."""
        model = target.module()
        if model is None:
            raise UsageError(
                "the target exposes no torch.nn.Module, so there are no layers to tap: record with "
                "`replay record --modules ATTR` naming the attribute that holds the model"
            )
        for name, mod in model.named_modules():
            if type(mod).forward is torch.nn.Module.forward:
                continue  # a container (ModuleList, a cache holder): it is never called
            tapped = self.matches(name)
            if tapped:
                self.tapped.append(name)
            self._wrap(name, mod, tapped)
        if self.patterns and not self.tapped:
            some = ", ".join(n for n, _ in itertools.islice(model.named_modules(), 1, 8))
            raise UsageError(f"--modules {','.join(self.patterns)} matches no module of the target (modules: {some}, ...)")
        if self._cuda:
            self._patch_graphs()
        if self._count is None:
            self._patch_collectives()
        return self.close

    def _wrap(self, name: str, mod: torch.nn.Module, tapped: bool) -> None:
        had = "forward" in mod.__dict__
        previous = mod.__dict__.get("forward")
        orig = mod.forward
        taps = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            frame = taps._enter(name)
            try:
                out = orig(*args, **kwargs)
            finally:
                taps._exit(frame)
            if tapped:
                taps._on_output(name, frame, args, kwargs, out)
            return out

        forward.__wrapped__ = orig  # type: ignore[attr-defined]
        # An instance attribute shadows the class's forward for nn.Module.__call__.
        object.__setattr__(mod, "forward", forward)

        def undo() -> None:
            if had:
                object.__setattr__(mod, "forward", previous)
            else:
                mod.__dict__.pop("forward", None)

        self._undo.append(undo)

    def _patch_graphs(self) -> None:
        graph_cls = torch.cuda.CUDAGraph
        orig_begin, orig_end, orig_replay = graph_cls.capture_begin, graph_cls.capture_end, graph_cls.replay
        taps = self

        def capture_begin(g: Any, *a: Any, **k: Any) -> Any:
            taps._begin_capture(g)
            try:
                return orig_begin(g, *a, **k)
            except BaseException:
                taps._end_capture(g)
                raise

        def capture_end(g: Any, *a: Any, **k: Any) -> Any:
            try:
                return orig_end(g, *a, **k)
            finally:
                taps._end_capture(g)

        def replay(g: Any, *a: Any, **k: Any) -> Any:
            out = orig_replay(g, *a, **k)
            taps._after_replay(g)
            return out

        # Patched on the class: graphs made before install (by an engine's runner) see it too.
        patched = {"capture_begin": capture_begin, "capture_end": capture_end, "replay": replay}
        originals = {"capture_begin": orig_begin, "capture_end": orig_end, "replay": orig_replay}
        for name, fn in patched.items():
            setattr(graph_cls, name, fn)

        def undo() -> None:
            for name, fn in originals.items():
                setattr(graph_cls, name, fn)

        self._undo.append(undo)

    def _patch_collectives(self) -> None:
        # Live collectives (or none): count calls into torch.distributed, so frames know which
        # module calls contain a reduction.
        try:
            import torch.distributed as dist
            import torch.distributed._functional_collectives as funcol
            from torch.distributed import distributed_c10d as c10d

            from replay.core.collectives import COLLECTIVES, FUNCTIONAL
        except ImportError:  # pragma: no cover - torch built without distributed
            return
        taps = self
        # The functional collectives too: DTensor (tensor parallelism) reduces through them.
        for owner, names in ((dist, COLLECTIVES), (c10d, COLLECTIVES), (funcol, FUNCTIONAL)):
            for name in names:
                orig = getattr(owner, name, None)
                if orig is None:
                    continue

                def counted(*a: Any, _orig: Any = orig, **k: Any) -> Any:
                    taps._own_count += 1
                    return _orig(*a, **k)

                setattr(owner, name, counted)
                self._undo.append(_restorer(owner, name, orig))

    def close(self) -> None:
        """Take every wrapper and patch out again (idempotent)."""
        while self._undo:
            self._undo.pop()()
        self._armed = False

    # -- the step ------------------------------------------------------------------------------

    def arm(self) -> None:
        """Start recording the events of one step."""
        self._armed = True
        self._events = []
        self._called = set()
        self._notes = []
        self._unit = {}
        self._stack = []
        self._replays = 0
        self._own_count = 0

    def disarm(self) -> TapCapture:
        """Stop; the step's events, in execution order, with tensors moved to the CPU."""
        self._armed = False
        if self._cuda:
            torch.cuda.synchronize()
        counts: dict[str, int] = {}
        for e in self._events:
            # Numbered per step, whether the call ran eagerly or inside a replayed graph.
            e.call = counts.get(e.module, 0)
            counts[e.module] = e.call + 1
            e.output = e.output.cpu()
            e.inputs = [t.cpu() for t in e.inputs]
        return TapCapture(events=self._events, tapped=list(self.tapped), called=set(self._called),
                          graphs_replayed=self._replays, notes=list(dict.fromkeys(self._notes)),
                          collectives=self._collectives())

    def _collectives(self) -> int:
        return self._count() if self._count is not None else self._own_count

    def _enter(self, name: str) -> Frame:
        parent = self._stack[-1].id if self._stack else None
        f = Frame(id=next(self._ids), module=name, parent=parent, coll_enter=self._collectives())
        self._unit[f.id] = f
        self._stack.append(f)
        if self._armed and not self._capturing_now():
            self._called.add(name)
        return f

    def _exit(self, frame: Frame) -> None:
        frame.coll_exit = self._collectives()
        if self._stack and self._stack[-1] is frame:
            self._stack.pop()
        elif frame in self._stack:  # an exception unwound inner frames without their exits
            del self._stack[self._stack.index(frame):]

    def _capturing_now(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _on_output(self, name: str, frame: Frame, args: tuple, kwargs: dict, out: Any) -> None:
        capturing = self._capturing_now()
        if not capturing and not self._armed:
            return  # warm-up, fast-forward and capture bookkeeping are not the step
        tensors = flatten_tensors(out)
        ins = flatten_tensors((args, kwargs)) if self.inputs else []
        source = "graph" if capturing else "eager"
        # Under capture, clone() allocates from the graph's pool and its copy kernel is captured:
        # every replay refreshes the copy. Eagerly it is a copy made now, before in-place code
        # later in the step can change the tensor.
        events = [
            TapEvent(module=name, index=i, n_out=len(tensors), output=_copy(t), inputs=[_copy(x) for x in ins],
                     source=source, frame=frame.id, frames=self._unit)
            for i, t in enumerate(tensors)
        ]
        if capturing:
            if self._capturing:
                _, evs, called = self._graphs[id(self._capturing[-1])]
                evs.extend(events)
                called.add(name)
            else:
                self._notes.append("a graph was captured through an API the taps do not see; its taps are lost")
        else:
            self._events.extend(events)

    # -- graphs --------------------------------------------------------------------------------

    def _begin_capture(self, g: Any) -> None:
        self._capturing.append(g)
        self._graphs[id(g)] = (g, [], set())
        self._saved_unit, self._unit = self._unit, {}
        if self._armed and self._events:
            # The graph is captured inside the step: what ran eagerly so far was its warm-up.
            self._notes.append(f"dropped {len(self._events)} tap events of a warm-up that ran before a capture inside the step")
            self._events = []

    def _end_capture(self, g: Any) -> None:
        if g in self._capturing:
            self._capturing.remove(g)
        if self._saved_unit is not None:
            self._unit, self._saved_unit = self._saved_unit, None

    def _after_replay(self, g: Any) -> None:
        if not self._armed:
            return
        self._replays += 1
        entry = self._graphs.get(id(g))
        if entry is None or not entry[1]:
            self._notes.append(
                "a CUDA graph replayed with no tap inside it (captured before the taps were installed, or "
                "with no tapped module): its modules have no outputs on this side"
            )
            return
        _, events, called = entry
        self._called |= called
        # Snapshot the graph's buffers in stream order: the next replay overwrites them.
        for e in events:
            self._events.append(TapEvent(module=e.module, index=e.index, n_out=e.n_out, output=_copy(e.output),
                                         inputs=[_copy(x) for x in e.inputs], source="graph", frame=e.frame, frames=e.frames))

    def __iter__(self) -> Iterator[str]:
        return iter(self.tapped)
