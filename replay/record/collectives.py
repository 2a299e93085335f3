"""torch.distributed instrumentation: every collective's inputs and outputs, and process groups.

Each wrapped call is recorded after it completes: op, group, shapes, dtypes, input and output
digests (and outputs in full with ``--collectives full``, which lets one rank be replayed alone).
In-place collectives are copied before the call so the input digest is of the input. Calls made
while a CUDA graph is being captured are passed straight through: they run inside the graph.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from replay.core.collectives import COLLECTIVES, FUNCTIONAL, FUNCTIONAL_PREFIX, CollectiveSpec
from replay.core.outputs import tensor_version
from replay.record.calls import cuda_capturing

__all__ = ["install", "install_functional", "COLLECTIVES", "CollectiveSpec", "FUNCTIONAL", "FUNCTIONAL_PREFIX"]


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def _stacked(ts: Any) -> torch.Tensor | None:
    """A list output (all_gather's tensor_list) as one tensor, so it is one recorded output."""
    ts = [t for t in ts if isinstance(t, torch.Tensor)]
    if not ts or any(t.shape != ts[0].shape or t.dtype != ts[0].dtype for t in ts):
        return None
    return torch.stack([t.detach() for t in ts])


class AsyncOutputs:
    """The outputs of a collective started with ``async_op=True``, taken when the program waits
    on its work, or else at the end of the step that started it: when its work is done by then
    and the program has not written into them since the call (their version counters), they hold
    what the collective gave."""

    __slots__ = ("work", "outputs", "compare", "versions")

    def __init__(self, work: Any, outputs: list[Any], compare: bool) -> None:
        self.work, self.outputs, self.compare = work, outputs, compare
        self.versions = [[tensor_version(t) for t in _tensors(v)] for v in outputs]

    def taken(self, *, waited: bool = False) -> list[torch.Tensor] | None:
        """The outputs now, as ``record_collective`` takes them; None: not done, or written
        since. ``waited``: the program's ``wait()`` on the work has just returned, so they are
        the collective's (copies queued now come after it on the program's stream)."""
        if not waited:
            try:
                if not self.work.is_completed():
                    return None
            except Exception:  # noqa: BLE001 - a Work that cannot say: not seen
                return None
            for v, versions in zip(self.outputs, self.versions):
                if None in versions or [tensor_version(t) for t in _tensors(v)] != versions:
                    return None  # written by the program since (or an inference tensor: cannot be told)
        outs = [_stacked(v) if isinstance(v, (list, tuple)) else v for v in self.outputs]
        return [t for t in outs if isinstance(t, torch.Tensor)]


def _hook_wait(session: Any, c10d: Any) -> None:
    """``Work.wait`` of every process group: when the program waits on an async collective of
    the open step, its outputs are recorded right then, before the program can write into them."""
    work_type = getattr(c10d, "Work", None)
    orig = getattr(work_type, "wait", None)
    if orig is None or getattr(orig, "__replay_wait__", False):
        return

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if not torch.compiler.is_compiling():
            rec = session.recorder
            if rec is not None and not session.disabled:
                rec.collective_waited(self)
        return out

    wait.__replay_wait__ = True  # type: ignore[attr-defined]
    try:
        work_type.wait = wait
    except (AttributeError, TypeError):  # a build whose Work refuses it: outputs at the step's end
        pass


def _group_name(dist: Any, group: Any) -> tuple[str, int]:
    try:
        size = dist.get_world_size(group)
    except Exception:  # noqa: BLE001
        size = 0
    if group is None:
        return "default", size
    return str(getattr(group, "group_name", None) or f"group{id(group)}"), size


def _wrap(session: Any, dist: Any, name: str, fn: Callable[..., Any], spec: CollectiveSpec) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    inplace = set(spec.inputs) & set(spec.outputs)

    def collective(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)  # traced: the recorder stays out of Dynamo's way
        rec = session.recorder
        if rec is None or session.disabled or cuda_capturing() or getattr(session._local, "in_collective", False):
            return fn(*args, **kwargs)
        try:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            before = {p: [t.detach().clone() for t in _tensors(a.get(p))] for p in inplace}
        except Exception:  # noqa: BLE001 - the program's own call decides what is valid
            return fn(*args, **kwargs)
        session._local.in_collective = True
        try:
            work = fn(*args, **kwargs)
        finally:
            session._local.in_collective = False
        try:
            ins = [t for p in spec.inputs for t in (before[p] if p in before else _tensors(a.get(p)))]
            outs = [_stacked(a.get(p)) if isinstance(a.get(p), (list, tuple)) else a.get(p) for p in spec.outputs]
            outs = [t for t in outs if isinstance(t, torch.Tensor)]
            pending = None
            if a.get("async_op") and work is not None:
                # The outputs are not there yet and Work objects cannot be wrapped safely: what
                # went in now, the outputs at the program's wait() (``_hook_wait``) or the step's end.
                pending = AsyncOutputs(work, [a.get(p) for p in spec.outputs], spec.compare)
                outs, compare = [], False
            else:
                compare = spec.compare
            group, size = _group_name(dist, a.get("group"))
            rec.record_collective(name, group=group, group_size=size, inputs=ins, outputs=outs, compare=compare,
                                  pending=pending)
        except Exception as e:  # noqa: BLE001
            session.warn_once(f"coll:{name}", f"cannot record {name} ({e})")
        return work

    import functools

    functools.update_wrapper(collective, fn)  # its signature, for Dynamo's rewrite of it (below)
    return collective


def _teach_dynamo(pairs: list[tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    """Dynamo turns torch.distributed's collectives into traceable ones by function identity,
    and checks ``fn in (dist.all_reduce, ...)``, which is now our wrapper: mapping each wrapper
    to what its original maps to makes a compiled program trace the same collective as without
    the recorder (else ``torch.compile`` of a step with ``dist.all_reduce`` raises)."""
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps as remaps
    except Exception:  # noqa: BLE001 - a torch without them: nothing to teach
        return
    for orig, wrapped in pairs:
        if orig in remaps:
            remaps[wrapped] = remaps[orig]


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's output, complete: wait on an AsyncCollectiveTensor now (it
    stays usable; the program's own later wait finds nothing left to wait for)."""
    trigger = getattr(t, "trigger_wait", None)
    return trigger() if callable(trigger) else t


def _functional_group(funcol: Any, dist: Any, group: Any, tag: str) -> tuple[str, int]:
    try:
        name = funcol._resolve_group_name(group, tag)
        return str(name), dist.get_world_size(dist.distributed_c10d._resolve_process_group(name))
    except Exception:  # noqa: BLE001 - a torch without these helpers: the op is still recorded
        return "functional", 0


def _wrap_functional(session: Any, funcol: Any, dist: Any, name: str, fn: Callable[..., Any], compare: bool) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    tracing = getattr(funcol, "_are_we_tracing", None)
    op = FUNCTIONAL_PREFIX + name

    def functional_collective(*args: Any, **kwargs: Any) -> Any:
        # Traced (torch.compile, fx) or captured: the collective belongs to a graph, not to us.
        if torch.compiler.is_compiling() or (tracing is not None and tracing()):
            return fn(*args, **kwargs)
        rec = session.recorder
        if rec is None or session.disabled or cuda_capturing() or getattr(session._local, "in_collective", False):
            return fn(*args, **kwargs)
        session._local.in_collective = True
        try:
            out = fn(*args, **kwargs)
        finally:
            session._local.in_collective = False
        try:
            a = sig.bind(*args, **kwargs).arguments
            first = next(iter(a.values()), None)
            from replay.digest import local_tensor

            ins = [local_tensor(t) for t in _tensors(first)]
            outs = [_waited(t) for t in _tensors(out)]
            group, size = _functional_group(funcol, dist, a.get("group"), str(a.get("tag") or ""))
            rec.record_collective(op, group=group, group_size=size, inputs=ins, outputs=outs, compare=compare)
        except Exception as e:  # noqa: BLE001
            session.warn_once(f"coll:{op}", f"cannot record {op} ({e})")
        return out

    return functional_collective


def install_functional(session: Any, funcol: Any) -> None:
    """Patch ``torch.distributed._functional_collectives`` once it is imported."""
    if getattr(funcol, "__replay_patched__", False):
        return
    import torch.distributed as dist

    for name, compare in FUNCTIONAL.items():
        fn = getattr(funcol, name, None)
        if callable(fn):
            setattr(funcol, name, _wrap_functional(session, funcol, dist, name, fn, compare))
    funcol.__replay_patched__ = True


def install(session: Any, dist: Any) -> None:
    """Patch torch.distributed (the package and distributed_c10d) once it is imported."""
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None or getattr(c10d, "__replay_patched__", False):
        return
    pairs = []
    for name, spec in COLLECTIVES.items():
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped = _wrap(session, dist, name, fn, spec)
        pairs.append((fn, wrapped))
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    _teach_dynamo(pairs)
    _hook_wait(session, c10d)
    orig_init = c10d.init_process_group
    orig_destroy = c10d.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = orig_init(*args, **kwargs)
        try:
            session.on_process_group()
        except Exception as e:  # noqa: BLE001
            session.warn_once("pg", f"cannot start recording for the new process group ({e})")
        return out

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None:
            try:
                session.close_recorder("ok")
            except Exception:  # noqa: BLE001
                pass
        return orig_destroy(*args, **kwargs)

    for owner in (c10d, dist):
        if getattr(owner, "init_process_group", None) is orig_init:
            owner.init_process_group = init_process_group
        if getattr(owner, "destroy_process_group", None) is orig_destroy:
            owner.destroy_process_group = destroy_process_group
    c10d.__replay_patched__ = True
