"""What ``replay record`` does inside each Python process it starts.

The session arms import hooks for the step callables (from ``--step`` and the built-in profiles),
torch.distributed, CUDA graphs and Triton's autotuner. It creates this process's ``Recorder``
when it learns its rank (``init_process_group``) or at the first step, and starts a new part for
every new process group, so a pytest file that launches several multi-rank runs gives one part
per run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from replay.textsafe import a_or_an
from replay import numerics
from replay.core.outputs import nested_outputs, tensor_version, written_arguments, written_outputs
from replay.log import get_logger
from replay.core.state import held_module, held_module_state
from replay.record.config import RecordConfig, RecorderConfig
from replay.record.calls import (
    Binder,
    argument_pairs,
    NotJSON,
    access,
    attribute_holding,
    capturing,
    config_settings,
    flatten_object,
    module_state,
    name_outputs,
    split_arguments,
    to_json_safe,
    unrecordable,
    weakrefable,
    without_parameters,
)
from replay.record.held_objects import Fingerprint
from replay.record.hooks import patch_callable, when_class_defined, when_imported
from replay.core.sources import source_digests, step_source_file
from replay.record.launch import launch_info, main_names, module_name
from replay.record.profiles import PROFILES, Profile, StepSpec
from replay.record.graph_events import GraphEvents
from replay.record.parts import PartStreams, Stream, allocate_part, new_stream_name
from replay.record.recorder import Recorder
from replay.record.tracebacks import program_caller_frame, without_recorder_frames

__all__ = ["Session", "allocate_part"]

log = get_logger("replay.record")



@dataclass(slots=True)
class _Early:
    """A step begun on the early path: its recorder, object, snapshots (by id of the argument)."""

    rec: Recorder
    obj: Any
    snaps: dict[int, torch.Tensor]
    versions: dict[int, int | None]  # the arguments' versions before the call (what a step returning None wrote)


def _binding_of(target: str, root: Any) -> str | None:
    """"staticmethod" or "classmethod" when ``target`` names one (as the class holds it), else None."""
    if "." not in target.partition(":")[2]:
        return None
    try:
        from replay.record.hooks import resolve

        value = resolve(target, root)[2]
    except Exception:  # noqa: BLE001 - patch_callable says why it cannot patch
        return None
    if isinstance(value, staticmethod):
        return "staticmethod"
    return "classmethod" if isinstance(value, classmethod) else None


def normalize_step(target: str) -> str:
    """``__main__:f`` -> ``generate:f`` for ``python generate.py``: one name for one callable."""
    mod, sep, qual = target.partition(":")
    return f"{module_name(mod)}{sep}{qual}" if sep else target


_MISSING = object()


def _step_model(obj: Any) -> tuple[str | None, torch.nn.Module | None]:
    """The model a step's object runs: the object itself, or the one model an engine object
    holds (``Engine.step`` with ``self.model``), with that attribute's name."""
    if isinstance(obj, torch.nn.Module):
        return None, obj
    held = held_module(obj)
    return (held[0], held[1]) if held is not None else (None, None)


def _model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """What the target info keeps of the step's model at its first recorded step: its weights'
    and buffers' digests, and how many of its modules are in training mode (dropout and batch
    norm compute otherwise there: a rank left without ``.eval()`` drifts from its first step)."""
    from replay.core.weights import buffer_digests, weight_digests

    return {"weights": weight_digests(model), "buffers": buffer_digests(model),
            "training": sum(1 for m in model.modules() if m.training)}


class Session(GraphEvents):
    """The recording state of one process (a singleton per process; see ``bootstrap``)."""

    early_path = True  # a benchmark compares it off (``bench_record.py --ab``)

    def __init__(self, out: Path, settings: RecordConfig) -> None:
        self.out = out
        self.settings = settings
        self.recorder: Recorder | None = None
        self.part: str | None = None
        self.disabled = False
        self.uncaught: str | None = None  # the error the program ended on (replay.record.auto)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._streams_lock = threading.RLock()
        self._streams = PartStreams()
        self._numerics: dict[str, dict[str, Any]] = {}
        self._first_numerics: str | None = None
        self._launch: dict[str, Any] | None = None
        self._ran: Counter[str] = Counter()
        self._recorded: Counter[str] = Counter()  # calls recorded as steps (not once the recorder stopped)
        self._chosen: list[dict[str, str]] = []
        self._inactive: set[str] = set()
        self._discover = not settings.steps
        self._main_pending: list[StepSpec] = []
        self._watcher: Any = None
        self._pg_runs = 0  # runs (engine objects) seen in the current process group
        self._pg_generation = 0
        self._graph_counter = 0
        self._key_stack: list[tuple[str, tuple, int]] = []  # (key, ints, graphs captured before)
        self._cuda_graphs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._cpu_graphs: dict[tuple, int] = {}
        self._cuda_captures = 0
        self._cuda_replays = 0
        self._step_replays = 0
        self._tuner_dirty = True
        self._last_tuner: dict[str, str] | None = None
        self._tuner_sources: list[Callable[[], dict[str, str]]] = []
        self.lockstep: Any = None
        self._warned: set[str] = set()
        self._nested_said: dict[str, list[str]] = {}  # step -> returned containers of tensors, not recorded
        # Calls of an async step made while another call of it was awaited (concurrent tasks):
        # not recorded (one rank's steps are one sequence), counted so that it is said.
        self._overlapped: Counter[str] = Counter()
        self._said_overlapped: Counter[str] = Counter()  # all parts' counts, for replay record's summary
        # Streams whose caller is checked at their next call: (target info, caller's frame, step).
        self._caller_checks: list[tuple[dict[str, Any], Any, str, int]] = []  # (..., the step's calls then)
        self._unrecorded_said: dict[str, list[str]] = {}  # step -> arguments recorded by class name only
        self._unrecorded_prints: dict[str, list[Fingerprint | None]] = {}  # their states at the step's first call
        # id(model) -> its calls that ran before its step was chosen (discovery chose it at one
        # of them): the recording's step 0 is the program's call after those.
        self.calls_before_recording: dict[int, int] = {}
        self._worker_close_pid = 0  # the process whose multiprocessing worker exit closes the recording
        # The thread closing the recorder now, and what a signal that interrupted that close on
        # its own thread asked to run once the close is over (``defer_until_closed``).
        self._closing_on: int | None = None
        self._after_close: Callable[[], None] | None = None
        self.census_checked: set[str] = set()  # classes asked whether they hold the part chosen first
        # New engines this process started after its first one died (each a new part): a
        # re-launched program counts them the same way to re-run a later part in its own engine.
        self._engine_runs = 0
        # target -> "staticmethod" or "classmethod" when it names one (how its calls bind, see _wrap_step)
        self._binding: dict[str, str | None] = {}

    # -- set-up ------------------------------------------------------------------------------

    def install(self) -> None:
        s = self.settings
        cli_specs = [StepSpec.from_config(t, s) for t in s.steps]
        for spec in cli_specs:
            self._arm_step(spec)
        # A function of the script run as __main__ is never imported by its name: it is
        # patched in the script's namespace once it exists (see ``_scan_main``).
        self._main_pending = [spec for spec in cli_specs]
        for t in s.graph_capture:
            self._arm(t, self._wrap_capture)
        for t in s.graph_replay:
            self._arm(t, self._wrap_replay)
        for t in s.probes:
            self._arm(t, lambda fn, tt: self._wrap_probe(fn, tt, ()))
        # (RecordConfig has checked the name)
        profiles = list(PROFILES.values()) if s.profile == "auto" else [PROFILES[s.profile]] if s.profile in PROFILES else []
        for p in profiles:
            when_imported(p.trigger, lambda _m, p=p: self._activate(p))
        from replay.record import collectives, compiled, cuda_graphs, discovery, tuners
        from replay.record.discovery import Watcher

        compiled.install(self)
        self._watcher = Watcher(
            on_outermost=self._on_outermost if self._discover else None,
            scan=self._scan_main if self._main_pending else None,
            on_loop=lambda outer, inner, calls: discovery.on_loop(self, outer, inner, calls),
            on_census=(lambda module: discovery.replaces_part(self, module)) if self._discover else None,
        )
        if self._discover or self._main_pending:
            self._watcher.install()
        if any("." not in spec.step.partition(":")[2] for spec in self._main_pending):
            from replay.record.discovery import watch_main_defs

            watch_main_defs({spec.step.partition(":")[2] for spec in self._main_pending}, self._main_defs_found)

        when_imported("torch.distributed", lambda m: collectives.install(self, m))
        when_imported("torch.distributed._functional_collectives", lambda m: collectives.install_functional(self, m))
        when_imported("torch.cuda.graphs", lambda m: cuda_graphs.install(self, m))
        when_imported("triton.runtime.autotuner", lambda m: tuners.install_triton(self, m))

    def _arm(self, target: str, make: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> None:
        module, _, qual = target.partition(":")
        when_imported(module, lambda _m: self._patch(target, make))
        if "." in qual:
            # The class may live in the script being run (``python module.py``), never imported.
            when_class_defined(module, qual.split(".")[0], lambda cls: self._patch(target, make, root=cls))

    def _patch(self, target: str, make: Callable[[Callable[..., Any], str], Callable[..., Any]], root: Any = None) -> None:
        try:
            self._binding[target] = _binding_of(target, root)
            patch_callable(target, make, root=root)
        except Exception as e:  # noqa: BLE001
            from replay.record.discovery import TORCHSCRIPT_HINT, is_torchscript

            self.warn_once(f"patch:{target}", f"cannot record {target}: {'it is ' + TORCHSCRIPT_HINT if is_torchscript(target) else e}")

    def _arm_step(self, spec: StepSpec) -> None:
        self._arm(spec.step, lambda fn, t, spec=spec: self._wrap_step(fn, t, spec))

    def _activate(self, p: Profile) -> None:
        # A profile names its steps: nothing is left to discover.
        self._discover = False
        if self._watcher is not None:
            self._watcher.done_discovering()
        for spec in p.steps:
            self._patch(spec.step, lambda fn, t, spec=spec: self._wrap_step(fn, t, spec))
        for t in p.graph_capture:
            self._patch(t, self._wrap_capture)
        for t in p.graph_replay:
            self._patch(t, self._wrap_replay)
        for t, names in p.probes:
            self._patch(t, lambda fn, tt, names=names: self._wrap_probe(fn, tt, names))

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # -- recorder lifecycle -------------------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        try:
            return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        except ValueError:
            return 0, 1

    def _new_recorder(self, part: str) -> Recorder | None:
        rank, world = self._rank_world()
        cfg = RecorderConfig.for_rank(self.settings, out=self.out, part=part, rank=rank, world_size=world)
        self.part = part
        self._streams = PartStreams()
        self._numerics = {}
        self._first_numerics = None
        self._cpu_graphs.clear()
        self._last_tuner = None
        self._tuner_dirty = True
        self.recorder = Recorder(cfg)
        streams = self._streams
        # When the recorder closes (the program's end, a new part), before its end marker.
        self.recorder.before_close.append(lambda rec: self._note_changed_models(rec, streams))
        self.recorder.before_close.append(self._note_overlapped)
        self._close_in_worker()
        return self.recorder

    def _close_in_worker(self) -> None:
        """In a ``multiprocessing`` worker: close the recording (its end marker, this process's
        report) when the worker ends. A forked worker ends with ``os._exit``, so no ``atexit``
        hook runs there; ``multiprocessing`` runs its own finalizers first. Once a process."""
        if self._worker_close_pid == os.getpid():
            return
        self._worker_close_pid = os.getpid()
        mp = sys.modules.get("multiprocessing")
        try:
            if mp is None or mp.parent_process() is None:
                return
            from multiprocessing import util

            util.Finalize(None, self.shutdown, exitpriority=-100)  # the last of them
        except Exception:  # noqa: BLE001 - the worker's recording is sealed by replay record anyway
            pass

    def ensure_recorder(self) -> Recorder | None:
        """This process's recorder, created now (rank 0 of 1 unless a process group says more)."""
        with self._lock:
            if self.disabled:
                return None
            if self.recorder is None:
                _rank, world = self._rank_world()
                part = allocate_part(self.out) if world == 1 else f"run-port{os.environ.get('MASTER_PORT', 'x')}"
                self._new_recorder(part)
            return self.recorder

    def on_process_group(self) -> None:
        """After ``init_process_group``: agree on a part with the other ranks and start recording."""
        import torch.distributed as dist

        self.scan_main()
        with self._lock:
            self.close_recorder("ok")
            self._pg_generation += 1
            self._pg_runs = 0
            try:
                part = self._agree_part(dist)
            except Exception as e:  # noqa: BLE001
                part = f"run-pid{os.getpid()}"
                self.warn_once("part", f"could not agree on a part name with the other ranks ({e}); using {part}")
            self._new_recorder(part)
            from replay.record.lockstep import Lockstep

            self.lockstep = Lockstep(self, dist) if self.settings.check_lockstep else None

    def _agree_part(self, dist: Any, run: int = 0) -> str:
        from datetime import timedelta

        store = dist.distributed_c10d._get_default_store()
        key = f"replay/part/{self._pg_generation}/{run}"
        if dist.get_rank() == 0:
            name = allocate_part(self.out)
            store.set(key, name)
            return name
        store.wait([key], timedelta(seconds=120))
        return store.get(key).decode()

    def close_recorder(self, status: str = "ok") -> None:
        with self._closing_scope():
            self._close_recorder(status)

    @contextlib.contextmanager
    def _closing_scope(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._closing_on == me:
            yield  # (shutdown's close of the recorder)
            return
        self._closing_on = me
        try:
            yield
        finally:
            if self._closing_on == me:
                self._closing_on = None
            then, self._after_close = self._after_close, None
            if then is not None:
                then()

    def defer_until_closed(self, action: Callable[[], None]) -> bool:
        """From a signal handler: if the signal interrupted this session's own close on this
        thread (a ``multiprocessing`` worker closing its recording at its exit, which
        ``Pool.terminate`` then terms), run ``action`` once that close is over and return True.
        Ending the process in the middle of the close would lose the part's end marker."""
        if self._closing_on != threading.get_ident():
            return False
        self._after_close = action
        return True

    def _close_recorder(self, status: str) -> None:
        with self._lock:
            rec = self.recorder
        if rec is not None:
            # A step still running (SIGTERM inside it, another thread starting a new part) has
            # not reached its after-call bookkeeping: its numerics context is read now.
            try:
                args = rec.open_step_args()
                if args is not None and numerics.NUMERICS_ARG not in args:
                    rec.add_open_step_args(**{numerics.NUMERICS_ARG: self._numerics_digest(rec)})
            except Exception:  # noqa: BLE001 - closing goes on (and may be closing after a failure)
                pass
        with self._lock:
            rec, self.recorder = self.recorder, None
        if rec is not None:
            self._record_tuner(force=True, rec=rec)
            rec.close(status, uncaught=self.uncaught)

    def _note_overlapped(self, rec: Recorder) -> None:
        """Calls of an async step that were not recorded because another call of it was being
        awaited: said in a note (for ``info``), or the recording would read as every call."""
        for step, n in sorted(self._overlapped.items()):
            rec.note(f"calls not recorded: {n} call(s) of {step} on rank {rec.config.rank} each began while another call "
                     "of it was being awaited (concurrent tasks on one event loop), and a rank's recorded steps are one "
                     "sequence of calls; to record every call, name a step the tasks do not run concurrently "
                     "(--step MODULE:QUALNAME)")
        self._said_overlapped.update(self._overlapped)
        self._overlapped.clear()

    def _note_changed_models(self, rec: Recorder, streams: PartStreams) -> None:
        """A stream's model whose parameters changed in names or shapes while recorded (an adapter
        added, a layer replaced): a re-run builds the model as it was at its first call, so no
        keyframe brings the steps after the change back. Kept in the stream's target info (for
        ``replay step``'s advice) and said in a note (for ``info``)."""
        changed = False
        for st in streams.streams:
            recorded = st.info.get("weights")
            obj = st.obj()
            model = _step_model(obj)[1]
            if not isinstance(recorded, dict) or not recorded or model is None:
                continue
            try:
                from replay.core.weights import describe_parameter_changes, parameter_changes

                changes = parameter_changes(recorded, model)
            except Exception:  # noqa: BLE001 - a model that cannot be walked now: nothing said
                continue
            if changes is None:
                continue
            st.info["parameters_changed"] = changes
            changed = True
            rec.note(f"the model of stream {st.name} on rank {rec.config.rank} changed its parameters after its first recorded step "
                     f"({describe_parameter_changes(changes)}): a re-run builds it as it was at that step, so steps "
                     "after the change do not re-run as recorded, and no keyframe restores that")
        if changed and streams is self._streams and streams.streams:
            rec.set_target(self._merged_info())

    # -- steps -------------------------------------------------------------------------------

    def _wrap_step(self, fn: Callable[..., Any], target: str, spec: StepSpec) -> Callable[..., Any]:
        from replay.record.compiled import is_compiled_callable

        sig = inspect.signature(fn)
        params = list(sig.parameters)
        binding = self._binding.get(target)
        # A module's forward is a method whatever its first parameter is called (``def forward(s, x)``).
        # A classmethod's object is its class (its first argument); a staticmethod has none: its
        # first argument is data, which would make every call a new object (a new part).
        # (``--step mod:Model`` names the class: the callable patched is its forward.)
        class_forward = fn.__name__ == "forward" and "." in fn.__qualname__ and "<locals>" not in fn.__qualname__
        is_method = binding != "staticmethod" and (
            bool(params) and params[0] in ("self", "cls") or "." in target.partition(":")[2] or spec.kind == "module_forward"
            or class_forward)
        if binding == "staticmethod" and spec.kind in ("", "method"):
            kind = "function"
        elif spec.kind:
            kind = spec.kind
        elif is_compiled_callable(fn):
            kind = "compiled"
        elif fn.__name__ == "forward" and is_method:
            kind = "module_forward"
        else:
            kind = "method" if is_method else "function"
        spec = replace(spec, step=normalize_step(spec.step), kind=kind)
        binder = Binder(sig)

        def step_wrapper(*args: Any, **kwargs: Any) -> Any:
            # Traced by Dynamo (the step is called inside a compiled region): only the call
            # itself, so nothing of the recorder (locks, thread-locals, I/O) is ever traced.
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            try:
                return self._call_step(spec, fn, binder, is_method, args, kwargs)
            except BaseException as e:
                raise e.with_traceback(without_recorder_frames(e.__traceback__))  # noqa: B904 - replay's recorder re-raises the step's own exception

        step_wrapper.__replay_step_fn__ = fn  # type: ignore[attr-defined]
        step_wrapper.__replay_spec__ = spec  # type: ignore[attr-defined]
        return step_wrapper

    def _call_step(self, spec: StepSpec, fn: Callable[..., Any], binder: Binder, is_method: bool, args: tuple, kwargs: dict) -> Any:
        if getattr(self._local, "depth", 0) or self.disabled or capturing() or spec.step in self._inactive:
            if getattr(self._local, "awaited", None) == spec.step and not self.disabled:
                self._overlapped[spec.step] += 1
            return fn(*args, **kwargs)
        self._local.depth = 1
        try:
            return self._run_step(spec, fn, binder, is_method, args, kwargs)
        finally:
            self._local.depth = 0

    # -- compiled callables and discovery -----------------------------------------------------

    def boundary(self, original: Callable[..., Any], compiled_fn: Callable[..., Any], *, spec: StepSpec | None = None) -> Callable[..., Any]:
        """The eager wrapper around a ``torch.compile``d function: a step when it is named (or
        found), a plain call otherwise. Dynamo never sees more than the call."""
        try:
            binder = Binder(inspect.signature(original))
        except (TypeError, ValueError):
            return compiled_fn
        target = f"{module_name(getattr(original, '__module__', '') or '?')}:{getattr(original, '__qualname__', '?')}"
        holder: dict[str, Any] = {"spec": replace(spec, step=normalize_step(spec.step), kind="compiled") if spec else None}

        def boundary_wrapper(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return compiled_fn(*args, **kwargs)
            s = holder["spec"]
            if s is None:
                s = self._boundary_spec(target, holder, args, kwargs)
                if s is None:
                    return compiled_fn(*args, **kwargs)
            try:
                return self._call_step(s, compiled_fn, binder, False, args, kwargs)
            except BaseException as e:
                raise e.with_traceback(without_recorder_frames(e.__traceback__))  # noqa: B904 - replay's recorder re-raises the step's own exception

        functools.update_wrapper(boundary_wrapper, original)
        boundary_wrapper.__replay_boundary__ = holder  # type: ignore[attr-defined]
        boundary_wrapper.__replay_step_fn__ = original  # type: ignore[attr-defined]
        boundary_wrapper.__replay_spec__ = holder["spec"]  # type: ignore[attr-defined]
        boundary_wrapper.__replay_wrapped__ = True  # type: ignore[attr-defined]
        return boundary_wrapper

    def module_boundary(self, module: torch.nn.Module, compiled_forward: Callable[..., Any]) -> Callable[..., Any]:
        """The eager wrapper around an ``OptimizedModule``'s compiled ``forward``: the step of
        ``module``'s class (named or found), recorded outside the traced frame."""
        cls = type(module)
        binder = Binder(inspect.signature(cls.forward))
        target = f"{module_name(cls.__module__)}:{cls.__qualname__}"
        holder: dict[str, Any] = {"spec": None}
        ref = weakref.ref(module)

        def call(_obj: Any, *args: Any, **kwargs: Any) -> Any:
            return compiled_forward(*args, **kwargs)

        def forward_boundary(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return compiled_forward(*args, **kwargs)
            s = holder["spec"]
            mod = ref()
            if s is None and mod is not None:
                s = self._boundary_spec(target, holder, (mod,), {})
            if s is None or mod is None:
                return compiled_forward(*args, **kwargs)
            try:
                return self._call_step(s, call, binder, True, (mod, *args), kwargs)
            except BaseException as e:
                raise e.with_traceback(without_recorder_frames(e.__traceback__))  # noqa: B904 - replay's recorder re-raises the step's own exception

        functools.update_wrapper(forward_boundary, compiled_forward)
        forward_boundary.__replay_boundary__ = holder  # type: ignore[attr-defined]
        return forward_boundary

    def _spec_from_settings(self, step: str, kind: str) -> StepSpec:
        return StepSpec.from_config(step, self.settings, kind=kind)

    def _named_spec(self, target: str) -> StepSpec | None:
        for t in self.settings.steps:
            if normalize_step(t) == target:
                return self._spec_from_settings(target, "compiled")
        return None

    def _boundary_spec(self, target: str, holder: dict[str, Any], args: tuple, kwargs: dict) -> StepSpec | None:
        named = self._named_spec(target)
        if named is not None:
            holder["spec"] = named
            return named
        if getattr(self._local, "depth", 0):
            return None
        # A named nn.Module step that runs inside this compiled callable cannot be seen there:
        # record at the nearest boundary, the compiled call that is given the module, and say so.
        wanted = {normalize_step(t) for t in self.settings.steps}
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.nn.Module):
                cls = type(v)
                mod_target = f"{module_name(cls.__module__)}:{cls.__qualname__}"
                if mod_target in wanted and mod_target != target:
                    spec = self._spec_from_settings(target, "compiled")
                    self._inactive.add(mod_target)
                    self._chosen.append({"step": target, "kind": "boundary", "inside": mod_target})
                    holder["spec"] = spec
                    return spec
        if not self._discover or getattr(self._local, "depth", 0):
            return None
        from replay.record import discovery  # issue 14: discovery's choices live there

        with self._lock:
            earlier = discovery.compiled_replaces(self._chosen, self._ran, target)
            if earlier is None:
                return None
            for c in earlier:
                # Prefill ran the model eagerly, decode runs compiled: the compiled callable is
                # the step, and the module chosen at prefill (which recorded nothing) is not.
                self._inactive.add(c["step"])
                self._chosen.remove(c)
            spec = self._spec_from_settings(target, "compiled")
            discovery.choose_compiled(self._chosen, target)
            holder["spec"] = spec
        return spec

    def _on_outermost(self, module: torch.nn.Module) -> str:
        from replay.record import discovery  # issue 14: discovery's choices live there

        return discovery.on_outermost(self, module)

    def _main_defs_found(self) -> bool:
        main = sys.modules.get("__main__")
        if not self._main_pending or main is None:
            return True
        names = main_names()
        wanted = {spec.step.partition(":")[2].split(".")[0] for spec in self._main_pending if spec.step.partition(":")[0] in names}
        if not wanted:
            return True  # no --step names the script: stop tracing at once
        if not wanted & set(main.__dict__):
            return False
        self.scan_main()
        return not self._main_pending

    def scan_main(self) -> None:
        """Look for the pending ``--step`` functions of ``__main__`` now (from other hooks)."""
        if self._main_pending and self._scan_main() and self._watcher is not None:
            self._watcher.done_scanning()

    def _scan_main(self) -> bool:
        """Patch the ``--step`` functions of the script run as ``__main__`` that exist by now;
        True once none is left to find."""
        main = sys.modules.get("__main__")
        if main is None:
            return False
        names = main_names()
        left = []
        for spec in self._main_pending:
            mod, _, qual = spec.step.partition(":")
            if mod not in names:
                continue  # a real module: its import hook patches it
            value = main.__dict__.get(qual.split(".")[0])
            if value is None:
                left.append(spec)
                continue
            holder = getattr(value, "__replay_boundary__", None)
            if isinstance(holder, dict) and "." not in qual:
                if holder.get("spec") is None:
                    holder["spec"] = replace(spec, step=normalize_step(spec.step), kind="compiled")
                continue
            self._patch(spec.step, lambda fn, t, spec=spec: self._wrap_step(fn, t, spec), root=main)
        self._main_pending = left
        return not left

    # -- the target and its streams -----------------------------------------------------------

    def _stream_info(self, spec: StepSpec, obj: Any, inputs: dict[str, torch.Tensor], object_arg: str | None) -> dict[str, Any]:
        info: dict[str, Any] = {**spec.to_json(), "step": spec.step, "step_kind": spec.kind or "function", "profile": spec.profile}
        info["factory"] = self.settings.factory or spec.factory
        from replay.record.compiled import arguments_for  # issue 14: torch.compile's arguments, as recorded

        info["compile"] = arguments_for(spec.step)
        config, config_attr, raw = self._config_of(spec, obj)
        info["config"] = config
        info["config_attr"] = config_attr
        info["config_settings"] = config_settings(raw)
        # A model's inputs on an accelerator say where it runs; a CPU tensor beside them (a
        # generator's state, a host-side index) does not.
        devices = sorted({str(t.device) for t in inputs.values()}, key=lambda d: (d == "cpu", d))
        info["device"] = devices[0] if devices else "cpu"
        probes = [[t, []] for t in self.settings.probes]
        if spec.profile in PROFILES:
            probes += [[t, list(names)] for t, names in PROFILES[spec.profile].probes]
        info["probes"] = probes
        info["object_arg"] = object_arg
        # Taken once: the first stream of this object; a later one (a new part) starts at a call.
        # Only a module's forward is taken at a counted call (a compiled step at its first).
        missed = self.calls_before_recording.pop(id(obj), 0) if obj is not None else 0
        info["unrecorded_calls"] = missed if spec.kind == "module_forward" else 0
        info["engine_run"] = self._engine_runs
        info["caller"], frame = program_caller_frame(module_name, spec.step)
        if frame is not None:
            # Held until the step's next call (then dropped): a frame that ended in between
            # cannot be taken for another at its address.
            self._caller_checks.append((info, frame, spec.step, self._ran[spec.step]))
        info["sources"] = source_digests([step_source_file(spec.step)])
        if spec.kind in ("module_forward", "compiled") and isinstance(obj, torch.nn.Module):
            # (a compiled forward too: ``m.forward = torch.compile(m.forward)`` is what is
            # recorded, and the module's hooks still run after it)
            self._note_output_hooks(spec, obj)
        info["state_from"] = "attribute" if spec.state else None
        # An engine object that holds one model (``Engine.step`` with ``self.model``): that
        # model's weights and buffers are the step's, as a re-run's ``Target.module()`` takes them.
        attr, model = _step_model(obj)
        if model is not None:
            if not spec.state:
                info["state_from"] = "module_buffers" if model is obj else f"held_module:{attr}"
            try:
                info.update(_model_facts(model))
            except Exception as e:  # noqa: BLE001
                self.warn_once(f"weights:{spec.step}", f"cannot digest the weights of {spec.step} ({e})")
        return info

    def _note_output_hooks(self, spec: StepSpec, module: torch.nn.Module) -> None:
        """The program's own forward hooks on the step's module run after its forward, which is
        what is recorded: a hook that rescales or masks the logits makes what ``model(x)`` gave
        the program differ from the recorded outputs. Said once, with the hooks' names."""
        hooks = list(getattr(module, "_forward_hooks", {}).values())
        if hooks:
            names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks[:3])
            self.warn_once(f"hooks:{spec.step}", f"{spec.step} has forward hooks of the program's ({names}): they run "
                           "after its forward, so the recorded outputs are forward's, before any change the hooks make "
                           "to what the program gets (to record that, name the function that calls the model with --step)")

    def _config_of(self, spec: StepSpec, obj: Any) -> tuple[Any, str | None, Any]:
        """The JSON-safe config a factory rebuilds the target from, the attribute it came from,
        and the config object itself."""
        if spec.config:
            try:
                raw = access(obj, spec.config)
                return to_json_safe(raw), spec.config, raw
            except Exception as e:  # noqa: BLE001
                self.warn_once(f"config:{spec.step}", f"cannot record the config of {spec.step} ({e}); re-runs will need --factory")
                return None, spec.config, None
        if obj is None:
            return None, None, None
        # No --config: a model's own ``config`` attribute, when it is data.
        for attr in ("config", "args", "cfg"):
            try:
                v = getattr(obj, attr, None)
            except Exception:  # noqa: BLE001 - a property that raises is not a config
                continue
            if v is None or callable(v) and not hasattr(v, "__dataclass_fields__"):
                continue
            try:
                return to_json_safe(v), attr, v
            except NotJSON:
                continue
        return None, None, None

    def _stream_state(self, spec: StepSpec, obj: Any) -> Callable[[], dict[str, torch.Tensor]] | None:
        if obj is None:
            return None
        ref = weakref.ref(obj) if weakrefable(obj) else (lambda o=obj: o)
        if spec.state:
            def state_fn(ref: Any = ref, name: str = spec.state) -> dict[str, torch.Tensor]:
                o = ref()
                if o is None:
                    return {}
                from replay.core.state import named_state

                st = named_state(access(o, name), name)
                if isinstance(o, torch.nn.Module):
                    # Keyframes never hold the weights (a re-run restoring them would undo the
                    # ones the user loaded): they are digested once, in the target info.
                    st, dropped = without_parameters(o, st)
                    if dropped:
                        self.warn_once(f"state-params:{name}", f"--state {name}: {len(dropped)} parameters (weights) left out of"
                                       " keyframes; weights are digested once per rank instead")
                return st

            return state_fn
        if isinstance(obj, torch.nn.Module):
            def buffers_fn(ref: Any = ref) -> dict[str, torch.Tensor]:
                o = ref()
                return module_state(o) if o is not None else {}

            return buffers_fn
        if held_module(obj) is not None:
            def held_fn(ref: Any = ref) -> dict[str, torch.Tensor]:
                o = ref()
                return (held_module_state(o) or {}) if o is not None else {}

            return held_fn
        return None

    def _merged_info(self) -> dict[str, Any]:
        streams = self._streams.streams
        info = dict(streams[0].info)
        info["stream"] = streams[0].name
        info["streams"] = {st.name: st.info for st in streams}
        if self._launch is None:
            self._launch = launch_info()
        info["launch"] = self._launch
        info["numerics"] = {"first": self._first_numerics, "contexts": dict(self._numerics)}
        return info

    def _find_stream(self, obj: Any, step: str) -> Stream | None:
        for st in self._streams.streams:
            if st.obj() is obj and st.info.get("step") == step:
                return st
        return None

    def _recorder_for(self, spec: StepSpec, obj: Any, inputs: dict[str, torch.Tensor], object_arg: str | None) -> tuple[Recorder | None, Stream | None]:
        # One thread at a time: two threads' first steps at once would each make a stream of
        # the same name (a model per worker thread).
        with self._streams_lock:
            return self._stream_recorder(spec, obj, inputs, object_arg)

    def _starts_a_part(self, spec: StepSpec, obj: Any) -> bool:
        """Whether a step on ``obj`` would begin a new part (a new engine once the earlier ones
        are gone), whose recorder no other thread's step holds."""
        streams = self._streams.streams
        return (bool(streams) and self._find_stream(obj, spec.step) is None
                and not any(s.weak and s.obj() is not None for s in streams))

    def _stream_recorder(self, spec: StepSpec, obj: Any, inputs: dict[str, torch.Tensor], object_arg: str | None) -> tuple[Recorder | None, Stream | None]:
        rec = self.ensure_recorder()
        if rec is None:
            return None, None
        st = self._find_stream(obj, spec.step)
        if st is not None:
            return rec, st
        # A new target object. While the earlier ones are alive it is another model of the same
        # loop (a draft beside its target): a new stream of this part. Once they are gone it is
        # a new run (a new engine after the first), so a new part.
        alive = [s for s in self._streams.streams if s.weak and s.obj() is not None]
        if self._streams.streams and not alive:
            rec = self._next_part()
            self._engine_runs += 1
        from replay.core.state import with_scalars  # keyframes keep the target's Python scalars too

        name = new_stream_name(self._streams.streams, spec.step, obj)
        weak = obj is not None and weakrefable(obj)
        ref = weakref.ref(obj) if weak else (lambda o=obj: o)
        st = Stream(name=name, ref=ref, weak=weak, info=self._stream_info(spec, obj, inputs, object_arg),
                    state=with_scalars(self._stream_state(spec, obj), ref))
        self._streams.streams.append(st)
        part_streams = self._streams
        rec.set_target(self._merged_info(), part_streams.state if any(s.state for s in part_streams.streams) else None)
        if len(part_streams.streams) > 1 and rec.step_index > 0:
            # The new stream's state must be in a keyframe before its first step.
            rec.snapshot_state()
        return rec, st

    def _next_part(self) -> Recorder:
        """Close this part and start the next. Ranks switch engines at the same point of the same
        program, so with a process group they agree on its name through the group's store;
        alone, a process takes the next free one."""
        import torch.distributed as dist

        _, world = self._rank_world()
        self.close_recorder()
        if world > 1 and dist.is_available() and dist.is_initialized():
            self._pg_runs += 1
            try:
                part = self._agree_part(dist, run=self._pg_runs)
            except Exception as e:  # noqa: BLE001
                part = f"run-pid{os.getpid()}-{self._pg_runs}"
                self.warn_once("part", f"could not agree on a part name with the other ranks ({e}); using {part}")
        else:
            part = allocate_part(self.out)
        rec = self._new_recorder(part)
        if self.lockstep is not None:
            self.lockstep.prefix = f"replay/ls/{part}"
        return rec

    def _recorder_failed(self, e: BaseException) -> None:
        """The recorder's own code failed around a step: warn once, stop recording, go on."""
        self.warn_once("session-failed", f"recording stopped: {e.__class__.__name__}: {e}")
        self.disabled = True
        try:
            self.close_recorder("failed")
        except Exception:  # noqa: BLE001
            pass

    def _run_step(self, spec: StepSpec, fn: Callable[..., Any], binder: Binder, is_method: bool, args: tuple, kwargs: dict) -> Any:
        try:
            early = self._early_step(spec, is_method, args, kwargs)
        except Exception as e:  # noqa: BLE001 - never into the program
            self._recorder_failed(e)
            return fn(*args, **kwargs)
        if early is not None:
            return self._run_early(spec, fn, binder, is_method, args, kwargs, early)
        try:
            bound = binder.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let the program see its own error
        try:
            rec, obj, tensors = self._before_step(spec, bound, is_method, args)
        except Exception as e:  # noqa: BLE001 - never into the program
            self._recorder_failed(e)
            return fn(*args, **kwargs)
        if rec is None:
            return fn(*args, **kwargs)

        def after_call() -> None:
            rec.record_args(**{numerics.NUMERICS_ARG: self._numerics_digest(rec)})

        return self._call_and_record(spec, fn, args, kwargs, rec, obj, after_call, written=lambda: tensors)

    def _call_and_record(self, spec: StepSpec, fn: Callable[..., Any], args: tuple, kwargs: dict, rec: Recorder, obj: Any,
                         after_call: Callable[[], None] | None = None,
                         written: Callable[[], dict[str, tuple[torch.Tensor, int | None]]] | None = None) -> Any:
        self._step_replays = 0
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            self._step_raised(e, rec, after_call)
            raise
        if inspect.iscoroutine(out):
            # ``async def step``: the call made a coroutine; the step runs, and ends, when the
            # program awaits it. Begun here, at the call, as a plain step is. (Asked of the
            # result, one isinstance, not of the function on every step.)
            return self._awaited_and_recorded(spec, out, rec, obj, after_call, written)
        return self._record_result(spec, out, rec, obj, after_call, written)

    async def _awaited_and_recorded(self, spec: StepSpec, coro: Any, rec: Recorder, obj: Any,
                                    after_call: Callable[[], None] | None,
                                    written: Callable[[], dict[str, tuple[torch.Tensor, int | None]]] | None) -> Any:
        # Steps other coroutines call while this one is awaited are not recorded: one rank's
        # steps are one sequence (as nested steps are not).
        self._local.depth = getattr(self._local, "depth", 0) + 1
        awaited, self._local.awaited = getattr(self._local, "awaited", None), spec.step
        try:
            out = await coro
        except BaseException as e:
            self._step_raised(e, rec, after_call)
            raise
        finally:
            self._local.depth -= 1
            self._local.awaited = awaited
        return self._record_result(spec, out, rec, obj, after_call, written)

    def _check_callers(self, step: str) -> None:
        """A stream's caller, at the step's next call after it was taken: when it is the same
        frame, that function runs the loop (a script's ``main``): recording it as the step would
        record the whole run as one step, so it is not offered."""
        keep = []
        for info, frame, s, calls in self._caller_checks:
            if s != step or self._ran[s] <= calls:  # another step, or the very call it was taken at
                keep.append((info, frame, s, calls))
                continue
            name, now = program_caller_frame(module_name, step)
            if name == info.get("caller") and now is frame:
                info["caller"] = None
                info["loop"] = name  # the function that runs the loop (not offered as the step)
                rec = self.recorder
                if rec is not None and self._streams.streams and any(st.info is info for st in self._streams.streams):
                    rec.set_target(self._merged_info())
        self._caller_checks = keep

    def _step_raised(self, e: BaseException, rec: Recorder, after_call: Callable[[], None] | None) -> None:
        if after_call is not None:
            self._safely(after_call)
        rec.end_step(error=e)
        rec.flush_ring(f"step raised {e.__class__.__name__}")

    def _record_result(self, spec: StepSpec, out: Any, rec: Recorder, obj: Any, after_call: Callable[[], None] | None,
                       written: Callable[[], dict[str, tuple[torch.Tensor, int | None]]] | None) -> Any:
        """Everything recorded after the step returned ``out``: its outputs, then the step's end."""
        if after_call is not None and not self._safely(after_call):
            return out
        if self._caller_checks:
            self._check_callers(spec.step)
        try:
            outs = name_outputs(out, spec.outputs or tuple(self.settings.output_names))
            if spec.step not in self._nested_said:
                self._nested_said[spec.step] = nested_outputs(out, spec.outputs or tuple(self.settings.output_names))
            if out is None and written is not None:
                # A step that returns nothing writes its results into its arguments
                # (``step(ids, out=logits)``): they are its outputs, as they are after the call.
                outs = written_outputs(written())
            if not outs:
                self._warn_nothing_recorded(spec, out, written)
            rec.record_outputs(**outs)
            self._set_run(rec, spec, obj)
            if self._tuner_dirty:
                self._record_tuner(obj=obj, spec=spec)
            rec.end_step()
        except Exception as e:  # noqa: BLE001 - the program gets its result
            self._recorder_failed(e)
            return out
        if self.lockstep is not None:
            self.lockstep.check(rec, outs)  # may raise LockstepDivergence on purpose
        return out

    def _warn_nothing_recorded(self, spec: StepSpec, out: Any,
                               written: Callable[[], dict[str, tuple[torch.Tensor, int | None]]] | None) -> None:
        """A step whose results the recorder could not see: said once, at record time."""
        if out is not None:
            self.warn_once(f"no-tensor:{spec.step}", f"{spec.step} returns a {type(out).__name__} with no tensor in "
                           "it: its results are not recorded, and a re-run of its steps has nothing to compare "
                           "(a step that returns its logits or tokens as tensors is compared)")
        elif written is not None:
            unseen = [n for n, (_t, v) in written().items() if v is None]
            why = (f" (its argument{'s' if len(unseen) > 1 else ''} {', '.join(unseen[:3])} "
                   f"{'are' if len(unseen) > 1 else 'is an'} inference tensor{'s' if len(unseen) > 1 else ''}, made "
                   "under torch.inference_mode, whose writes cannot be told)" if unseen else "")
            self.warn_once(f"no-written:{spec.step}", f"{spec.step} returns None and wrote into no tensor argument "
                           f"the recorder could see{why}: nothing it computes is recorded, and a re-run of its "
                           "steps has nothing to compare (a step that returns its logits, or writes them into "
                           "an argument made outside torch.inference_mode, is compared)")

    def _safely(self, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - never into the program
            self._recorder_failed(e)
            return False

    # -- the early path: the step's bookkeeping after its call ----------------------------------

    def _early_step(self, spec: StepSpec, is_method: bool, args: tuple, kwargs: dict) -> _Early | None:
        """A CUDA step of a known stream with tensors only at the top level of its arguments:
        begin the step and snapshot its tensor arguments (one ``_foreach_copy_``, queued before
        the step's own work), and leave the rest of the bookkeeping (binding, naming, the
        numerics context, the record's entries) until the call has been queued, so that the
        device does not wait for the host's recorder between steps. None: the full path before
        the call."""
        rec = self.recorder
        if not self.early_path or rec is None or not rec.early_ok():
            return None
        obj = args[0] if is_method and args else None
        if not is_method or self._find_stream(obj, spec.step) is None:
            return None  # a function step's object comes from binding; a new stream: full path
        tensors: list[torch.Tensor] = []
        for v in (*args[1:], *kwargs.values()):
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor or not v.is_cuda or unrecordable(v) is not None:
                    return None
                tensors.append(v)
            elif isinstance(v, (list, tuple, dict, torch.Generator)):
                # Containers may hold tensors: the full path looks into them; a generator's
                # state is taken before the call.
                return None
            elif flatten_object("_", v) is not None and attribute_holding(obj, v) is None:
                # A data object (``step(batch)``) whose tensors ``split_arguments`` records: the
                # full path copies them before the call.
                return None
        # ``checked``: ``_call_step`` has just seen that no graph is being captured.
        if not tensors or rec.begin_step(checked=True) < 0:
            return None
        self._ran[spec.step] += 1
        self._recorded[spec.step] += 1
        copies = rec.snapshot_arguments(tensors)
        return _Early(rec=rec, obj=obj, snaps={id(t): c for t, c in zip(tensors, copies)},
                      versions={id(t): tensor_version(t) for t in tensors})

    def _run_early(self, spec: StepSpec, fn: Callable[..., Any], binder: Binder, is_method: bool, args: tuple,
                   kwargs: dict, early: _Early) -> Any:
        arg_tensors: dict[str, tuple[torch.Tensor, int | None]] = {}

        def after_call() -> None:
            try:
                bound = binder.bind(*args, **kwargs)
            except TypeError:
                return  # the program's own error (the call raised it too): the step ends as raised
            tensors, scalars = split_arguments(bound, skip_first=is_method, owner=early.obj)
            arg_tensors.update(written_arguments(tensors, scalars, early.versions))
            for copy in early.snaps.values():
                early.rec.adopt_snapshot(copy)
            early.rec.record_inputs(**{n: early.snaps.get(id(t), t) for n, t in tensors.items()})
            scalars[numerics.NUMERICS_ARG] = self._numerics_digest(early.rec)
            stream = self._find_stream(early.obj, spec.step)
            if len(self._streams.streams) > 1 and stream is not None:
                scalars[numerics.STREAM_ARG] = stream.name
            early.rec.record_args(**scalars)
            self._note_unrecorded(spec.step, scalars, bound, is_method)

        return self._call_and_record(spec, fn, args, kwargs, early.rec, early.obj, after_call, written=lambda: arg_tensors)

    def _before_step(self, spec: StepSpec, bound: inspect.BoundArguments, is_method: bool, args: tuple) -> tuple[Recorder | None, Any, dict[str, torch.Tensor]]:
        """Everything recorded before the call: the target (and its stream), inputs, arguments
        (the numerics context comes after the call). (None, obj, {}) when this step is not recorded; the tensors are the step's arguments."""
        self._ran[spec.step] += 1
        object_arg = None
        if is_method:
            obj = args[0] if args else None
        else:
            # A function step whose argument is the model (``decode_one_token(model, x, pos)``):
            # that model is the step's object (its state, weights, stream).
            obj = None
            for k, v in bound.arguments.items():
                if isinstance(v, torch.nn.Module):
                    obj, object_arg = v, k
                    break
        rec = self.recorder
        if rec is not None and not self._starts_a_part(spec, obj) and not rec.records_this_thread():
            return None, obj, {}  # another thread's step is open: not a stream of this recording
        tensors, scalars = split_arguments(bound, skip_first=is_method, owner=obj if is_method else None,
                                           target_arg=obj if object_arg else None)
        rec, stream = self._recorder_for(spec, obj, tensors, object_arg)
        if rec is None or not rec.enabled:
            return None, obj, {}
        if rec.begin_step() < 0:
            # Another thread began a step since ``records_this_thread`` (this one is left out
            # from here on), or the recorder failed: the call runs unrecorded, and uncounted.
            return None, obj, {}
        self._recorded[spec.step] += 1
        rec.record_inputs(**tensors)
        if len(self._streams.streams) > 1 and stream is not None:
            scalars[numerics.STREAM_ARG] = stream.name
        rec.record_args(**scalars)
        self._note_unrecorded(spec.step, scalars, bound, is_method)
        return rec, obj, written_arguments(tensors, scalars)

    def _note_unrecorded(self, step: str, scalars: dict[str, Any], bound: inspect.BoundArguments, is_method: bool) -> None:
        """Once per step: its arguments recorded by class name only (a cache object with methods,
        HF's DynamicCache), which a re-run cannot set back, for ``replay record``'s summary; with
        each, a fingerprint of its state now, so that the summary leaves out one the program did
        not change (a frozen model beside the step's own)."""
        prints = self._unrecorded_prints.get(step)
        if prints:
            # A later call: the same objects, or the summary must warn of them.
            values = dict(argument_pairs(bound, is_method))
            for fp in prints:
                if fp is not None and not fp.changed and values.get(fp.name, _MISSING) is not fp.obj:
                    fp.changed = True
        if step in self._unrecorded_said:
            return
        names = [k for k, v in scalars.items() if isinstance(v, dict) and isinstance(v.get("unrecorded"), str)]
        self._unrecorded_said[step] = [f"{k} ({a_or_an(scalars[k]['unrecorded'])})" for k in names]
        values = dict(argument_pairs(bound, is_method)) if names else {}
        # A tensor whose values cannot be recorded is always said: its values are data, not an object's state.
        self._unrecorded_prints[step] = [Fingerprint(k, values[k]) if k in values and not isinstance(values[k], torch.Tensor) else None
                                         for k in names]

    def _unrecorded_changed(self) -> dict[str, list[str]]:
        """The arguments recorded by class name only that changed while recorded (or whose
        change cannot be told)."""
        out = {}
        for step, items in self._unrecorded_said.items():
            prints = self._unrecorded_prints.get(step) or [None] * len(items)
            changed = [item for item, fp in zip(items, prints) if fp is None or not fp.same_now()]
            if changed:
                out[step] = changed
        return out

    def _numerics_digest(self, rec: Recorder) -> str:
        """The digest of the numerics context now; a context not seen in this part is written
        with the target info (with the ring, that frame follows the open step's own).

        Read when the step's call has returned, not before: the context the program set around
        the call is still in force then, a setting the step changed and kept is the one its
        kernels ran under (torch sets the SDPA backends' priority at the first attention call),
        and on the early path the read is off the time before the device gets the step."""
        digest, ctx, _changed = numerics.current()
        # Only the current part's contexts: a step of a part another thread has since closed
        # must not mark the context as written for the new part.
        if rec is self.recorder and digest not in self._numerics:
            self._numerics[digest] = ctx
            if self._first_numerics is None:
                self._first_numerics = digest
            rec.set_target(self._merged_info())
        return digest

    def _set_run(self, rec: Recorder, spec: StepSpec, obj: Any) -> None:
        info = None
        if spec.run_info:
            try:
                info = access(obj, spec.run_info)
            except Exception as e:  # noqa: BLE001
                self.warn_once(f"run_info:{spec.step}", f"cannot read {spec.run_info} ({e})")
        if isinstance(info, dict) and info.get("mode") in ("graph", "eager"):
            rec.set_run(
                str(info["mode"]),
                key=str(info.get("key", "")),
                padded_size=int(info.get("padded_size", -1) or -1),
                reason=str(info.get("reason", "")),
            )
        elif not self._step_replays:
            rec.set_run("eager", reason="no graph replayed during the step")

    def _wrap_probe(self, fn: Callable[..., Any], target: str, names: tuple[str, ...]) -> Callable[..., Any]:
        label = target.partition(":")[2].split(".")[-1]
        logits_name = "logits"
        sig = inspect.signature(fn)
        binder = Binder(sig)
        # Where a plain ``logits`` parameter comes positionally (found without binding each call).
        params = list(sig.parameters.values())
        at = next((i for i, p in enumerate(params) if p.name == logits_name), -1)
        logits_at = at if at >= 0 and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[: at + 1]) else -1

        def probe_wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            rec = self.recorder
            if rec is not None and getattr(self._local, "depth", 0) and not capturing():
                rec.record_probe(label, **name_outputs(out, names))
                if logits_at >= 0:
                    lg = args[logits_at] if logits_at < len(args) else kwargs.get(logits_name)
                else:
                    try:
                        lg = binder.bind(*args, **kwargs).arguments.get(logits_name)
                    except TypeError:
                        lg = None
                if isinstance(lg, torch.Tensor):
                    rec.record_logits(lg)
            return out

        return probe_wrapper

    # -- tuner choices -----------------------------------------------------------------------

    def add_tuner_source(self, fn: Callable[[], dict[str, str]]) -> None:
        self._tuner_sources.append(fn)
        self._tuner_dirty = True

    def _record_tuner(self, *, obj: Any = None, spec: StepSpec | None = None, force: bool = False, rec: Recorder | None = None) -> None:
        rec = rec or self.recorder
        if rec is None:
            return
        choices: dict[str, str] = {}
        if spec is not None and spec.tuner and obj is not None:
            try:
                choices.update({str(k): str(v) for k, v in (access(obj, spec.tuner) or {}).items()})
            except Exception as e:  # noqa: BLE001
                self.warn_once(f"tuner:{spec.step}", f"cannot read tuner choices ({e})")
        for src in self._tuner_sources:
            try:
                choices.update(src())
            except Exception:  # noqa: BLE001
                pass
        self._tuner_dirty = False
        if choices and choices != self._last_tuner:
            self._last_tuner = choices
            rec.record_tuner(choices)

    # -- graphs ------------------------------------------------------------------------------

    # -- end ---------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What this process saw: for ``replay record``'s summary (see ``discovery``)."""
        rank, world = self._rank_world()
        return {
            "pid": os.getpid(),
            "rank": rank,
            "world": world,
            "named": [normalize_step(t) for t in self.settings.steps],
            "ran": dict(self._ran),
            "recorded": dict(self._recorded),
            "chosen": list(self._chosen),
            "seen": dict(self._watcher.seen) if self._watcher is not None else {},
            "nested_outputs": {k: v for k, v in self._nested_said.items() if v},
            "overlapped": dict(self._said_overlapped + self._overlapped),
            "unrecorded_arguments": self._unrecorded_changed(),
        }

    def shutdown(self) -> None:
        with self._closing_scope():
            self.close_recorder("ok")
            from replay.record.discovery import write_report

            write_report(self.out, self.report())
