"""What ``replay record`` does inside each Python process it starts.

The session arms import hooks for the step callables (from ``--step`` and the built-in profiles),
torch.distributed, CUDA graphs and Triton's autotuner. It creates this process's ``Recorder``
when it learns its rank (``init_process_group``) or at the first step, and starts a new part for
every new process group, so a pytest file that launches several multi-rank runs gives one part
per run.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from replay.format import perms as _perms  # issue 16
from replay.log import get_logger
from replay.record.config import RecorderConfig
from replay.record.calls import access, call_key, capturing, name_outputs, split_arguments, weakrefable
from replay.record.hooks import patch_callable, when_class_defined, when_imported
from replay.record.profiles import PROFILES, Profile, StepSpec
from replay.record.recorder import Recorder
from replay.record.settings import RecordSettings

__all__ = ["Session", "allocate_part"]

log = get_logger("replay.record")



def allocate_part(out: Path) -> str:
    """Create the next free ``run-NNN`` directory (atomic, also across nodes on a shared FS)."""
    # An unwritable directory must not raise into the program (this runs inside its step or
    # init_process_group call, and the other ranks wait for rank 0's answer): the name is
    # returned anyway, and the recorder that cannot open it switches itself off with a warning.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError:
        return "run-000"
    for i in range(100_000):
        name = f"run-{i:03d}"
        try:
            _perms.mkdir(out / name)  # issue 16: owner-only unless widened, whatever the umask
            return name
        except FileExistsError:
            continue
        except OSError:
            return name
    raise RuntimeError(f"no free part name under {out}")


class Session:
    """The recording state of one process (a singleton per process; see ``bootstrap``)."""

    def __init__(self, out: Path, settings: RecordSettings) -> None:
        self.out = out
        self.settings = settings
        self.recorder: Recorder | None = None
        self.part: str | None = None
        self.disabled = False
        self._lock = threading.RLock()
        self._local = threading.local()
        self._target_id: int | None = None
        self._target_ref: Any = None
        self._pg_runs = 0  # runs (engine objects) seen in the current process group
        self._targets_in_part = 0
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

    # -- set-up ------------------------------------------------------------------------------

    def install(self) -> None:
        s = self.settings
        cli_specs = [
            StepSpec(
                step=t,
                state=s.state,
                config=s.config,
                factory=s.factory,
                tuner=s.tuner,
                run_info=s.run_info,
                modules=s.modules,
                outputs=tuple(s.outputs),
            )
            for t in s.steps
        ]
        for spec in cli_specs:
            self._arm_step(spec)
        for t in s.graph_capture:
            self._arm(t, self._wrap_capture)
        for t in s.graph_replay:
            self._arm(t, self._wrap_replay)
        for t in s.probes:
            self._arm(t, lambda fn, tt: self._wrap_probe(fn, tt, ()))
        if s.profile not in ("none", "auto") and s.profile not in PROFILES:
            raise ValueError(f"unknown profile {s.profile!r} (profiles: {', '.join(PROFILES)}, auto, none)")
        profiles = list(PROFILES.values()) if s.profile == "auto" else [PROFILES[s.profile]] if s.profile in PROFILES else []
        for p in profiles:
            when_imported(p.trigger, lambda _m, p=p: self._activate(p))
        from replay.record import collectives, cuda_graphs, tuners

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
            patch_callable(target, make, root=root)
        except Exception as e:  # noqa: BLE001
            self.warn_once(f"patch:{target}", f"cannot record {target}: {e}")

    def _arm_step(self, spec: StepSpec) -> None:
        self._arm(spec.step, lambda fn, t, spec=spec: self._wrap_step(fn, t, spec))

    def _activate(self, p: Profile) -> None:
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
        s = self.settings
        cfg = RecorderConfig(
            out=self.out,
            part=part,
            rank=rank,
            world_size=world,
            durability=s.durability,
            keyframe_every=s.keyframe_every,
            ring=s.ring,
            inputs=s.inputs,
            collectives=s.collectives,
            max_bytes=s.max_bytes,
        )
        self.part = part
        self._targets_in_part = 0
        self._target_id = None
        self._cpu_graphs.clear()
        self._last_tuner = None
        self._tuner_dirty = True
        self.recorder = Recorder(cfg)
        return self.recorder

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

    def _is_current_target(self, obj: Any) -> bool:
        if self._target_id is None:
            return False
        if self._target_ref is not None:
            # A weak reference, not id(): a new engine can reuse a freed one's address.
            return self._target_ref() is obj
        return self._target_id == (id(obj) if obj is not None else 0)

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
        with self._lock:
            rec, self.recorder = self.recorder, None
        if rec is not None:
            self._record_tuner(force=True, rec=rec)
            rec.close(status)

    # -- steps -------------------------------------------------------------------------------

    def _wrap_step(self, fn: Callable[..., Any], target: str, spec: StepSpec) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        params = list(sig.parameters)
        is_method = bool(params) and params[0] in ("self", "cls") or "." in target.partition(":")[2]

        def step_wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) or self.disabled or capturing():
                return fn(*args, **kwargs)
            self._local.depth = 1
            try:
                return self._run_step(spec, fn, sig, is_method, args, kwargs)
            finally:
                self._local.depth = 0

        return step_wrapper

    def _target_info(self, spec: StepSpec, obj: Any, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        info: dict[str, Any] = {"step": spec.step, "profile": spec.profile, **spec.to_json()}
        info["factory"] = self.settings.factory or spec.factory
        try:
            info["config"] = access(obj, spec.config)
            json.dumps(info["config"])
        except Exception as e:  # noqa: BLE001
            info["config"] = None
            self.warn_once(f"config:{spec.step}", f"cannot record the config of {spec.step} ({e}); re-runs will need --factory")
        devices = {str(t.device) for t in inputs.values()}
        info["device"] = sorted(devices)[0] if devices else "cpu"
        probes = [[t, []] for t in self.settings.probes]
        if spec.profile in PROFILES:
            probes += [[t, list(names)] for t, names in PROFILES[spec.profile].probes]
        info["probes"] = probes
        return info

    def _recorder_for(self, spec: StepSpec, obj: Any, inputs: dict[str, torch.Tensor]) -> Recorder | None:
        rec = self.ensure_recorder()
        if rec is None:
            return None
        if self._is_current_target(obj):
            return rec
        if self._target_id is not None:
            # A new engine object in the same process: a new run, so a new part. Ranks switch
            # engines at the same point of the same program, so with a process group they agree
            # on its name through the group's store; alone, a process takes the next free one.
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
        self._target_id = id(obj) if obj is not None else 0
        self._target_ref = weakref.ref(obj) if obj is not None and weakrefable(obj) else None
        state_fn = None
        if spec.state and obj is not None:
            ref = weakref.ref(obj) if weakrefable(obj) else (lambda o=obj: o)

            def state_fn(ref: Any = ref, name: str = spec.state) -> dict[str, torch.Tensor]:
                o = ref()
                return dict(access(o, name) or {}) if o is not None else {}

        rec.set_target(self._target_info(spec, obj, inputs), state_fn)
        return rec

    def _run_step(self, spec: StepSpec, fn: Callable[..., Any], sig: inspect.Signature, is_method: bool, args: tuple, kwargs: dict) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let the program see its own error
        obj = args[0] if is_method and args else None
        tensors, scalars = split_arguments(bound, skip_first=is_method, owner=obj)
        rec = self._recorder_for(spec, obj, tensors)
        if rec is None or not rec.enabled:
            return fn(*args, **kwargs)
        rec.begin_step()
        rec.record_inputs(**tensors)
        if scalars:
            rec.record_args(**scalars)
        self._step_replays = 0
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            rec.end_step(error=e)
            rec.flush_ring(f"step raised {e.__class__.__name__}")
            raise
        outs = name_outputs(out, spec.outputs or tuple(self.settings.outputs))
        rec.record_outputs(**outs)
        self._set_run(rec, spec, obj)
        if self._tuner_dirty:
            self._record_tuner(obj=obj, spec=spec)
        rec.end_step()
        if self.lockstep is not None:
            self.lockstep.check(rec, outs)
        return out

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
        sig = inspect.signature(fn)
        logits_name = "logits"

        def probe_wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            rec = self.recorder
            if rec is not None and getattr(self._local, "depth", 0) and not capturing():
                rec.record_probe(label, **name_outputs(out, names))
                try:
                    lg = sig.bind(*args, **kwargs).arguments.get(logits_name)
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

    def _next_graph_id(self) -> int:
        gid = self._graph_counter
        self._graph_counter += 1
        return gid

    def current_graph_key(self) -> tuple[str, int]:
        if self._key_stack:
            key, ints, _ = self._key_stack[-1]
            return key, (ints[0] if len(ints) == 1 else -1)
        return f"graph{self._graph_counter}", -1

    def on_cuda_graph_captured(self, graph: Any, kernels: list[dict[str, Any]], pool: int) -> None:
        self._cuda_captures += 1
        self._tuner_dirty = True
        rec = self.ensure_recorder()
        if rec is None:
            return
        key, padded = self.current_graph_key()
        gid = self._next_graph_id()
        try:
            self._cuda_graphs[graph] = gid
        except TypeError:
            pass
        rec.record_graph(key, graph_id=gid, padded_size=padded, pool=pool, kernels=kernels, source="torch.cuda.CUDAGraph")

    def on_cuda_graph_replayed(self, graph: Any) -> None:
        self._cuda_replays += 1
        self._step_replays += 1
        gid = self._cuda_graphs.get(graph) if graph is not None else None
        if self.recorder is not None and gid is not None:
            self.recorder.record_graph_replay(gid)

    def _wrap_capture(self, fn: Callable[..., Any], target: str) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def capture_wrapper(*args: Any, **kwargs: Any) -> Any:
            key, ints = call_key(sig, args, kwargs)
            self._key_stack.append((key, ints, self._cuda_captures))
            ops: list[dict[str, Any]] | None = None
            try:
                if torch.cuda.is_available():
                    out = fn(*args, **kwargs)
                else:
                    from replay.record.cuda_graphs import OpLog

                    with OpLog() as oplog:
                        out = fn(*args, **kwargs)
                    ops = oplog.kernels
            finally:
                _, _, captures_before = self._key_stack.pop()
            if self._cuda_captures == captures_before:
                # A runner without a CUDA graph (on CPU, or a custom one): record it here, with
                # the operators it ran while capturing as its "kernels".
                rec = self.ensure_recorder()
                gid = self._next_graph_id()
                self._cpu_graphs[ints] = gid
                self._tuner_dirty = True
                if rec is not None:
                    rec.record_graph(key, graph_id=gid, padded_size=ints[0] if len(ints) == 1 else -1, kernels=ops or [], source=target)
            return out

        return capture_wrapper

    def _wrap_replay(self, fn: Callable[..., Any], target: str) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def replay_wrapper(*args: Any, **kwargs: Any) -> Any:
            before = self._cuda_replays
            out = fn(*args, **kwargs)
            if self._cuda_replays == before:
                _, ints = call_key(sig, args, kwargs)
                gid = self._cpu_graphs.get(ints)
                self._step_replays += 1
                if gid is not None and self.recorder is not None:
                    self.recorder.record_graph_replay(gid)
            return out

        return replay_wrapper

    # -- end ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.close_recorder("ok")
