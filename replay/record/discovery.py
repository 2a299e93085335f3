"""Finding the step when nobody named it, and saying what was found.

With no ``--step`` and no profile in force, the first candidate seen becomes the step:

* a function compiled with ``torch.compile`` called outside any other step (recorded at the
  compiled callable's boundary, outside the traced frame); it replaces a module chosen before
  it that has not recorded a step yet (prefill ran eagerly, decode runs compiled);
* else the outermost ``nn.Module`` whose forward runs (the first outermost call, usually the
  prefill, picks it; every later call of that class's ``forward`` is a step). When that first
  call was a part of a model called on its own before the loop (``generate()`` runs an
  encoder-decoder's encoder once, then the whole model each step) and an outermost call of a
  module holding that part comes before the part recorded a step, the holder is the step instead.

Global module hooks watch for that, and for functions named by ``--step`` that live in the script
run as ``__main__`` (they are patched in its namespace at the first module call after they exist),
and are removed as soon as nothing is left to find. Each process writes what it saw to
``<out>/session-<pid>.json``; ``replay record`` turns those into its summary lines.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from replay.record.calls import tracing
from replay.record.hooks import patch_callable
from replay.record.launch import module_name

__all__ = ["NOTHING_RAN", "Watcher", "write_report", "read_reports", "summary_lines", "on_outermost", "on_loop", "replaces_part", "choose_module", "step_name",
           "compiled_replaces", "choose_compiled", "graph_replay_step"]

# A --step function of __main__ not seen after this many module calls is given up on (the
# hooks cost every module call a few µs while installed).
_MAX_SCANS = 10_000
# Outermost module calls seen without one that can be chosen (only compiled modules, say)
# before discovery stops watching: its hooks must not cost a whole run.
_MAX_OUTERMOST = 200
# Outermost module calls still counted after the step is chosen, so that the summary can name
# another model the loop calls at the top level (a target beside the draft chosen first).
_CENSUS = 64


# Modules of torch's quantization tooling (observers, fake quantizers), which it calls while it
# converts a model, before the program's loop, and of its parametrizations (``parametrize``
# computes a weight by calling them when the model reads it, an outermost call before the
# model's own): never chosen as the step.
_TOOLING = ("torch.ao.quantization.", "torch.quantization.", "torch.nn.utils.parametrize", "torch.nn.utils.parametrizations")


class Watcher:
    """Global module-call hooks, installed while something is left to find.

    ``on_outermost(module)`` answers each outermost module call: ``"chosen"`` (its class is the
    step now), ``"keep"`` (keep looking) or ``"stop"``. While the call that chose runs, the
    watcher looks one level in: a module instance (with submodules) called twice there means
    the chosen module runs the whole loop (a wrapper called once, the model inside it many
    times), and ``on_loop(outer, inner, calls)`` is told (``calls``: the inner module's calls
    so far, the last one running); discovery stops when that call returns."""

    def __init__(self, *, on_outermost: Callable[[torch.nn.Module], str] | None, scan: Callable[[], bool] | None,
                 on_loop: Callable[[torch.nn.Module, torch.nn.Module, int], None] | None = None,
                 on_census: Callable[[torch.nn.Module], bool] | None = None) -> None:
        self.on_outermost = on_outermost
        self.on_loop = on_loop
        # Asked at each outermost call counted after the choice: True when that call's module
        # is the step now (it replaced the choice); its call is then watched as a chosen one's.
        self.on_census = on_census
        self.scan = scan
        self.seen: Counter[str] = Counter()
        self._local = threading.local()
        self._handles: list[Any] = []
        self._scans = 0
        self._inside: torch.nn.Module | None = None
        self._inner: Counter[int] = Counter()
        self.census_left = 0  # outermost calls still to count after the choice

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        if self._handles:
            return
        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def done_discovering(self) -> None:
        if self.on_outermost is not None:
            self.census_left = _CENSUS
        self.on_outermost = None
        self._inside = None
        self._remove_if_idle()

    def done_scanning(self) -> None:
        self.scan = None
        self._remove_if_idle()

    def _remove_if_idle(self) -> None:
        """The hooks go once nothing watches: no discovery, no scan, no census left."""
        if self.on_outermost is None and self._inside is None and self.scan is None and not self.census_left:
            self.remove()

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            return None
        try:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            if self.scan is not None:
                self._scans += 1
                if self.scan() or self._scans > _MAX_SCANS:
                    self.done_scanning()
            if depth == 0:
                self._outermost(module)
            elif depth == 1 and self._inside is not None:
                self._one_level_in(module)
        except Exception:  # noqa: BLE001 - never into the program
            self.remove()
        return None

    def _outermost(self, module: torch.nn.Module) -> None:
        if _in_jit_trace():
            return  # torch.jit.trace running the module to build or check its graph: not the program's call
        cls = type(module)
        if not cls.__module__.startswith(_TOOLING):  # not a candidate: not named as one either
            self.seen[f"{module_name(cls.__module__)}:{cls.__qualname__}"] += 1
        if self.on_outermost is None:
            if self.census_left:
                self.census_left -= 1
                if self.on_census is not None and self.on_census(module):
                    self._inside, self._inner = module, Counter()
                    return
                self._remove_if_idle()
            return
        answer = self.on_outermost(module)
        if answer == "chosen":
            self._inside, self._inner = module, Counter()
        elif answer == "stop" or sum(self.seen.values()) > _MAX_OUTERMOST:
            self.done_discovering()

    def _one_level_in(self, module: torch.nn.Module) -> None:
        if next(iter(module.children()), None) is None:
            return  # a leaf called twice (an activation, a norm) is part of a model, not a loop
        self._inner[id(module)] += 1
        if self._inner[id(module)] >= 2:
            outer = self._inside
            self.done_discovering()
            if self.on_loop is not None and outer is not None:
                self.on_loop(outer, module, self._inner[id(module)])

    def _post(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if torch.compiler.is_compiling():
            return None
        depth = max(0, getattr(self._local, "depth", 1) - 1)
        self._local.depth = depth
        if depth == 0 and self._inside is not None:
            self.done_discovering()  # the chosen module's call returned: it is the step
        return None


def replaces_part(session: Any, module: torch.nn.Module) -> bool:
    """An outermost call counted after the choice: when the module chosen at the first outermost
    call has recorded no step and ``module`` (of another class) holds an instance of it, that
    first call was a part run on its own before the loop (an encoder-decoder's encoder, which
    ``generate()`` calls once): ``module``'s class is the step instead, from its next call."""
    cls = type(module)
    part = _part_to_replace(session, step_name(cls))
    if part is None or not _may_choose(module) or not any(step_name(type(m)) == part for m in module.modules() if m is not module):
        return False
    with session._lock:
        if session._ran.get(part):
            return False
        session._inactive.add(part)
        session._chosen = [c for c in session._chosen if c["step"] != part]
    return choose_module(session, cls, running=module, part=part)


def _part_to_replace(session: Any, target: str) -> str | None:
    """The one module chosen at the first outermost call, while it has recorded no step, when
    ``target`` (another class, asked once) might hold it; else None."""
    with session._lock:
        found = [c for c in session._chosen if c["kind"] == "module_forward" and not c.get("inside") and not c.get("direct")]
        if len(found) != 1 or len(session._chosen) != 1 or session._ran.get(found[0]["step"]) or target == found[0]["step"]:
            return None
        if target in session.census_checked:
            return None
        session.census_checked.add(target)
        return str(found[0]["step"])


def _may_choose(module: torch.nn.Module) -> bool:
    """A module call that can be the step: its class can be patched, it is no tooling's, and no
    tracer is calling it."""
    cls = type(module)
    return not (cls.__name__ == "OptimizedModule" or "<locals>" in cls.__qualname__ or isinstance(module, torch.jit.ScriptModule)
                or cls.__module__.startswith(_TOOLING) or tracing())


def step_name(cls: type) -> str:
    return f"{module_name(cls.__module__)}:{cls.__qualname__}"


def on_outermost(session: Any, module: torch.nn.Module) -> str:
    """The first outermost module call of an undiscovered program: its class's forward is the
    step (its later calls are recorded: this one is already running)."""
    if not session._discover or session._chosen or session.disabled:
        return "stop"
    cls = type(module)
    if cls.__name__ == "OptimizedModule" or "<locals>" in cls.__qualname__ or isinstance(module, torch.jit.ScriptModule):
        return "keep"  # compiled, scripted or traced modules and local classes cannot be patched: keep looking
    if tracing() or _in_jit_trace():
        return "keep"  # torch.jit.trace / fx calling the module to build (or check) a graph: not the program's loop
    if cls.__module__.startswith(_TOOLING):
        return "keep"  # an observer run by quantize_dynamic/prepare (calibration): not the program's loop
    owner = direct_forward_owner(module)
    if owner is not None:
        # ``model.forward(ids)`` (or ``fwd = model.forward``) skips nn.Module.__call__, so the
        # hooks see the model's first submodule as the outermost call: the model is the step.
        ocls = type(owner)
        if ocls.__name__ == "OptimizedModule" or "<locals>" in ocls.__qualname__:
            return "keep"
        choose_module(session, ocls, running=owner, direct="forward")
        return "stop"
    if _torch_layer(cls.__module__):
        # One of torch's own layers (not a container, which may be the whole model) is the
        # outermost module, called by a function of the program: the engine calling it is no
        # nn.Module (a plain class holding layers), and its method is the step a user wants.
        from replay.record.tracebacks import program_caller

        caller = program_caller(module_name, step_name(cls))
        return "chosen" if choose_module(session, cls, running=module, **({"caller": caller} if caller else {})) else "stop"
    return "chosen" if choose_module(session, cls, running=module) else "stop"


_MAX_FRAMES = 64


def _in_jit_trace() -> bool:
    """Called from within ``torch.jit.trace``: its check of the trace runs the module eagerly,
    outside the tracer, with the example inputs."""
    import sys

    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_filename.replace(os.sep, "/").endswith("torch/jit/_trace.py"):
            return True
        frame = frame.f_back
    return False


def _torch_layer(module: str) -> bool:
    """A class of torch's own layers (``torch.nn.modules.linear``), not a container."""
    return module.startswith("torch.nn.modules.") and module != "torch.nn.modules.container"


def direct_forward_owner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost module whose ``forward`` is running on this thread's stack and holds
    ``module``, called directly (the hooks saw no module call around this one); None if none."""
    import sys

    owner = None
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount >= 1:
            first = frame.f_locals.get(code.co_varnames[0])
            if isinstance(first, torch.nn.Module) and first is not module and _holds(first, module):
                owner = first
        frame = frame.f_back
    return owner


def _holds(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def choose_module(session: Any, cls: type, *, running: torch.nn.Module, calls: int = 1, **note: str) -> bool:
    """``cls``'s forward is the step from its next call on. ``running`` is the instance whose
    ``calls`` calls (the last one running now) the recording misses: a re-run inside the
    re-launched program lets that many calls run before it takes one (``unrecorded_calls``),
    so that the program's own objects (a KV cache the prefill filled) are as at step 0."""
    target = step_name(cls)
    session.calls_before_recording[id(running)] = calls
    if target in session._inactive:
        # Chosen before and set aside (a part that a holder replaced, which turned out to run
        # the loop): its forward is still wrapped.
        session._inactive.discard(target)
        session._chosen.append({"step": target, "kind": "module_forward", **note})
        return True
    spec = session._spec_from_settings(target, "module_forward")
    session._chosen.append({"step": target, "kind": "module_forward", **note})
    try:
        patch_callable(f"{cls.__module__}:{cls.__qualname__}", lambda fn, t, spec=spec: session._wrap_step(fn, t, spec))
    except Exception as e:  # noqa: BLE001
        session._chosen.pop()
        session.calls_before_recording.pop(id(running), None)
        session.warn_once(f"discover:{target}", f"cannot record {target}: {e}")
        return False
    return True


def graph_replay_step(session: Any, call: tuple[Any, tuple, dict, Any], replay: Callable[[], Any]) -> Any:
    """A replay of a CUDA graph captured around ``call`` (module, args, kwargs, output), outside
    any step: recorded as a step of that module, its inputs the static input tensors as the
    program filled them, its outputs the static outputs the replay wrote."""
    import inspect

    module, args, kwargs, out = call
    cls = type(module)
    result: list[Any] = []

    def run(*_a: Any, **_k: Any) -> Any:
        result.append(replay())
        return out

    try:
        if cls.__name__ == "OptimizedModule" or "<locals>" in cls.__qualname__:
            return replay()
        target = step_name(cls)
        spec = session._spec_from_settings(target, "module_forward")
        sig = inspect.signature(cls.forward)
        with session._lock:
            mine = [c for c in session._chosen if c["step"] == target]
            if not mine:
                session._chosen.append({"step": target, "kind": "cuda_graph"})
            elif mine[0]["kind"] == "module_forward":
                mine[0]["kind"] = "cuda_graph"
    except Exception:  # noqa: BLE001 - never into the program: a plain replay
        return replay()
    session._call_step(spec, run, sig, True, (module, *args), kwargs)
    return result[0] if result else None


def compiled_replaces(chosen: list[dict[str, str]], ran: Counter[str], target: str) -> list[dict[str, str]] | None:
    """The earlier choices a compiled callable ``target`` replaces as the step (modules chosen
    eagerly that recorded nothing: prefill ran eagerly, decode runs compiled), or None when it
    is not the step. Another instance of a compiled module already chosen is a stream of it."""
    same = [c for c in chosen if c["step"] == target]
    earlier = [c for c in chosen if c["kind"] != "compiled" and not ran.get(c["step"]) and c["step"] != target]
    if same:
        # The module chosen eagerly is the one whose call is compiled (``m.forward =
        # torch.compile(m.forward)``): one step, recorded at the compiled boundary.
        for c in same:
            c["kind"] = "compiled"
        return earlier
    return None if chosen and not earlier else earlier


def choose_compiled(chosen: list[dict[str, str]], target: str) -> None:
    if not any(c["step"] == target for c in chosen):
        chosen.append({"step": target, "kind": "compiled"})


def on_loop(session: Any, outer: torch.nn.Module, inner: torch.nn.Module, calls: int) -> None:
    """``outer`` (chosen at its first call) runs the loop: the module it calls repeatedly is
    the step instead (every instance of its class, a draft and its target being streams)."""
    outer_target = step_name(type(outer))
    with session._lock:
        if session._ran.get(outer_target) or not any(c["step"] == outer_target for c in session._chosen):
            return  # it recorded steps already, or a compiled callable replaced it
        session._inactive.add(outer_target)
        session._chosen = [c for c in session._chosen if c["step"] != outer_target]
    cls = type(inner)
    if cls.__name__ == "OptimizedModule":
        return  # its compiled forward's boundary records it
    if "<locals>" not in cls.__qualname__:
        choose_module(session, cls, running=inner, calls=calls, inside=outer_target)


def write_report(out: Path, data: dict[str, Any]) -> None:
    """This process's findings, for ``replay record``'s summary (best effort)."""
    p = out / f"session-{os.getpid()}.json"
    tmp = out / f".session-{os.getpid()}.json.part"
    try:
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, p)
    except (OSError, TypeError, ValueError):
        try:
            tmp.unlink()  # a full disk must not leave a stray temp file
        except OSError:
            pass


def read_reports(out: Path) -> list[dict[str, Any]]:
    reports = []
    for p in sorted(out.glob("session-*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            reports.append(d)
    return reports


_HOW = {
    "compiled": "a torch.compile'd callable",
    "module_forward": "the outermost nn.Module's forward",
    "cuda_graph": "replays of a CUDA graph the program captured around this nn.Module's call",
}


def _merged(reports: list[dict[str, Any]]) -> tuple[Counter[str], set[str], dict[str, dict[str, Any]], Counter[str]]:
    """(calls per step, steps named, the first choice per step, outermost module calls seen)."""
    ran: Counter[str] = Counter()
    named: set[str] = set()
    chosen: dict[str, dict[str, Any]] = {}
    seen: Counter[str] = Counter()
    for r in reports:
        # Calls recorded, where the process counted them apart from the calls it saw (a recorder
        # that stopped itself saw the program's later calls but recorded none).
        recorded = r.get("recorded") if isinstance(r.get("recorded"), dict) else {}
        ran.update({str(k): int(recorded.get(k, v)) for k, v in (r.get("ran") or {}).items()})
        named.update(str(s) for s in r.get("named") or [])
        for c in r.get("chosen") or []:
            if isinstance(c, dict):
                chosen.setdefault(str(c.get("step")), c)
        seen.update({str(k): int(v) for k, v in (r.get("seen") or {}).items()})
    return ran, named, chosen, seen


def _chosen_line(step: str, c: dict[str, Any], n: int) -> str:
    from replay.textsafe import escape

    kind = str(c.get("kind"))
    how = _HOW.get(kind, kind)
    if kind == "module_forward" and c.get("direct"):
        how = "the outermost nn.Module, its forward called directly"
    if kind == "module_forward" and c.get("inside"):
        how = f"the nn.Module called repeatedly inside {escape(str(c['inside']))}, which runs the loop"
    if kind == "module_forward" and c.get("part"):
        how = (f"the outermost nn.Module's forward, which holds {escape(str(c['part']))}: that part, called on its own "
               "first, is not the step")
    # Chosen at its first call, already running: step 0 is the program's second call (said, as
    # the program's own step count is one ahead of the recording's).
    first = ", from its second call: the first, which revealed it, ran unrecorded" if kind == "module_forward" and not \
        c.get("inside") else ""
    if kind == "module_forward" and c.get("caller"):
        # A layer of torch's own, called by the program's function: the engine around it is a
        # plain object, whose method is the step.
        caller = escape(str(c["caller"]))
        return (f"replay: step found with no flags: {escape(step)} ({how}, {n} call{'s' if n != 1 else ''} recorded{first}); "
                f"it is one of torch's own layers, a piece of a model, called by {caller}: if that is your engine's step "
                f"(an engine that is no nn.Module), record it instead: replay record --step {caller} -- ...")
    return (f"replay: step found with no flags: {escape(step)} ({how}, {n} call{'s' if n != 1 else ''} recorded{first});"
            f" to record another callable: replay record --step MODULE:QUALNAME -- ...")


def _unreported_line(step: str, c: dict[str, Any], held: int) -> str:
    """The step was chosen, and the recording holds steps, but no process reported running it: the
    one that did ended without its exit hooks (``os._exit``, as a forked child ends, or a kill)."""
    return (_chosen_line(step, c, held).replace(f"{held} call{'s' if held != 1 else ''} recorded",
                                                f"{held} step{'s' if held != 1 else ''} in the recording")
            .replace("; to record another", "; recorded by a process that ended without reporting (os._exit, as a "
                     "forked child ends, or a kill); to record another"))


# What a TorchScript module (torch.jit.script, torch.jit.trace) is called as: its forward runs
# in the TorchScript interpreter, no Python frame the recorder can wrap.
TORCHSCRIPT_HINT = ("TorchScript (torch.jit.script or trace), whose forward runs no Python that replay can record: name the "
                    "Python function that calls the model with --step MODULE:FUNCTION, or record the model before it "
                    "is scripted")


def is_torchscript(step: str) -> bool:
    return step.startswith("torch.jit.")


def _torchscript_seen(seen: Counter[str]) -> str:
    from replay.textsafe import escape

    ts = [k for k in seen if is_torchscript(k)]
    return f"; {', '.join(escape(k) for k in ts[:3])} {'is' if len(ts) == 1 else 'are'} {TORCHSCRIPT_HINT}" if ts else ""


def _nothing_found(seen: Counter[str], chosen: str | None = None, direct: bool = False) -> str:
    from replay.textsafe import escape

    if chosen is not None and direct:
        # ``fwd = model.forward`` before recording began: the bound method keeps the class's
        # forward as it was, so the patched one never runs. A --step patches the class as it
        # is defined, before the program binds the method.
        return (f"replay: no step recorded: {escape(chosen)} is the model (its forward is called directly), but the "
                f"program calls it through a method bound before recording could patch it (`fwd = model.forward`); "
                f"name it: replay record --step {escape(chosen)}.forward -- ...")
    if chosen is not None:
        # Found at its first call, which was already running: it never ran again (the program
        # went on with a traced or scripted copy, say), so no step of it is in the recording.
        most = ", ".join(f"{escape(k)} ({v})" for k, v in seen.most_common(5)) or "none"
        return (f"replay: no step recorded: {escape(chosen)} was chosen at its first call but never ran again;"
                f" outermost nn.Module calls seen: {most}; name the step with --step MODULE:QUALNAME")
    if seen:
        most = ", ".join(f"{escape(k)} ({v})" for k, v in seen.most_common(5))
        if all(is_torchscript(k) for k in seen):
            return f"replay: no step found; outermost nn.Module calls seen: {most}{_torchscript_seen(seen)}"
        return (f"replay: no step found; outermost nn.Module calls seen: {most}; name the step with --step MODULE:QUALNAME"
                + _torchscript_seen(seen))
    return NOTHING_RAN


# Said when no process saw any model run (``replay record`` says otherwise of a command that was
# interrupted or killed before it got there).
NOTHING_RAN = ("replay: no step found: no nn.Module forward or torch.compile'd function ran;"
               " name the step with --step MODULE:QUALNAME")


def _not_recorded_beside(chosen: dict[str, dict[str, Any]], seen: Counter[str], ran: Counter[str]) -> list[str]:
    """Other modules the loop called at the top level, more than once, beside a step found with
    no flags (a target model beside the draft chosen first): not recorded, and how to add them."""
    from replay.textsafe import escape

    found = [s for s, c in chosen.items() if c.get("kind") == "module_forward" and ran.get(s)]
    if not found or all(chosen[s].get("caller") for s in found):
        return []  # torch's own layers: the step found is a piece of the engine's (said with it), and so are these
    # (a wrapper that ran the loop, and a part of the step's model called on its own: not models beside it)
    wrappers = {str(c.get(k)) for c in chosen.values() for k in ("inside", "part") if c.get(k)}
    others = [(k, v) for k, v in seen.most_common() if v >= 2 and k not in found and k not in wrappers]
    if not others:
        return []
    names = ", ".join(f"{escape(k)} ({v} calls seen)" for k, v in others[:4])
    flags = " ".join(f"--step {escape(s)}" for s in [*found, *(k for k, _ in others[:2])])
    return [f"replay: also called at the top level, not recorded: {names}; to record them too: replay record {flags} -- ..."]


def summary_lines(reports: list[dict[str, Any]], *, recorded_steps: int = 0) -> list[str]:
    """What ``replay record`` says about steps: which was chosen and how to choose another, or
    what was seen when none was found, and every named step that never ran."""
    from replay.textsafe import escape

    ran, named, chosen, seen = _merged(reports)
    # A named nn.Module step inside a compiled callable is recorded at that callable's boundary.
    inside = {str(c.get("inside")): step for step, c in chosen.items() if c.get("kind") == "boundary"}
    lines = [
        f"replay: --step {escape(mod_step)} runs inside torch.compile'd {escape(at)}, where the recorder cannot see:"
        f" recorded at that boundary ({ran.get(at, 0)} calls)"
        for mod_step, at in inside.items()
    ]
    unreported = not sum(ran.values()) and recorded_steps > 0
    lines += [_chosen_line(step, c, ran.get(step, 0)) if ran.get(step) or c.get("kind") != "module_forward"
              else _unreported_line(step, c, recorded_steps) if unreported
              else _nothing_found(seen, step, bool(c.get("direct"))) for step, c in chosen.items() if c.get("kind") != "boundary"]
    lines += [f"replay: --step {escape(step)} never ran: no call of it was seen ("
              + ("it is " + TORCHSCRIPT_HINT if is_torchscript(step) else "check the module and qualname" + _torchscript_seen(seen)
                 .replace("; ", "; if it was scripted or traced: ", 1)) + ")"
              for step in sorted(named) if not ran.get(step) and step not in inside]
    if not chosen and not named:
        lines += _nothing_chosen(reports, seen, ran, recorded_steps)
    lines += _not_recorded_beside(chosen, seen, ran)
    lines += _compiled_collectives(reports, chosen, ran)
    lines += _nested_outputs(reports)
    lines += _overlapped(reports)
    lines += _unrecorded_arguments(reports)
    return lines


def _overlapped(reports: list[dict[str, Any]]) -> list[str]:
    """Calls of an async step not recorded because another call of it was being awaited."""
    from replay.textsafe import escape

    counts: Counter[str] = Counter()
    for r in reports:
        o = r.get("overlapped")
        if isinstance(o, dict):
            counts.update({str(k): int(v) for k, v in o.items() if isinstance(v, int)})
    return [f"replay: {escape(step)}: {n} call(s) not recorded: each began while another call of it was being awaited "
            "(concurrent tasks); a rank's recorded steps are one sequence of calls (replay info says so too)"
            for step, n in sorted(counts.items()) if n > 0]


def _nothing_chosen(reports: list[dict[str, Any]], seen: Counter[str], ran: Counter[str], recorded_steps: int) -> list[str]:
    """No process reported a step, chosen or named: none was found, or the processes that recorded
    ended without their exit hooks (``os._exit``, a kill), their steps in the recording."""
    if recorded_steps:
        return [f"replay: {recorded_steps} step{'s' if recorded_steps != 1 else ''} recorded by a process that ended "
                "without reporting what it chose (os._exit, or a kill): replay info names the step"]
    return [_nothing_found(seen)] if not ran and reports else []


def _unrecorded_arguments(reports: list[dict[str, Any]]) -> list[str]:
    """Arguments recorded by class name only (a cache object with methods): said at record time,
    as a re-run cannot set back what they hold, only re-run the steps that fill them."""
    from replay.textsafe import escape

    said: dict[str, list[str]] = {}
    for r in reports:
        for step, items in (r.get("unrecorded_arguments") or {}).items():
            if isinstance(items, list) and items:
                said.setdefault(str(step), [str(i) for i in items])
    return [f"replay: {escape(step)} takes {escape(', '.join(items[:4]))}, recorded by class name only: a re-run "
            "uses the re-launched program's own object and re-runs every step before the one asked for to fill it; "
            "what the program changes in it between steps is not reproduced (see 'Objects a step takes' in "
            "docs/your-engine.md)" for step, items in said.items()]


def _nested_outputs(reports: list[dict[str, Any]]) -> list[str]:
    """Tensors a step returned inside a container (a list, a cache tuple): not recorded, said so."""
    from replay.textsafe import escape

    said: dict[str, list[str]] = {}
    for r in reports:
        for step, items in (r.get("nested_outputs") or {}).items():
            if isinstance(items, list) and items:
                said.setdefault(str(step), [str(i) for i in items])
    return [f"replay: {escape(step)} also returned {escape(', '.join(items[:4]))}{', ...' if len(items) > 4 else ''}: "
            "not recorded or compared (only tensors at the top level of a step's result are; a cache passed back "
            "each step usually is one of these)" for step, items in said.items()]


def _compiled_collectives(reports: list[dict[str, Any]], chosen: dict[str, dict[str, Any]], ran: Counter[str]) -> list[str]:
    """Where the recorder cannot see: a compiled step of a multi-rank run has its collectives
    inside the compiled graph, never through torch.distributed's Python functions."""
    from replay.textsafe import escape

    world = max((int(r.get("world") or 1) for r in reports), default=1)
    compiled = [step for step, c in chosen.items() if c.get("kind") in ("compiled", "boundary") and ran.get(step)]
    if world < 2 or not compiled:
        return []
    return [f"replay: {escape(compiled[0])} ran compiled on {world} ranks: collectives inside it run inside its graph"
            " and are not recorded one by one, so one rank cannot re-run alone on them; re-run all ranks, or record"
            " with the program's compile off for that"]


def watch_main_defs(names: set[str], found: Callable[[], bool]) -> bool:
    """Call ``found()`` after each top-level line of the script run as ``__main__`` until it
    returns True, so a ``--step`` function of the script is patched right after its ``def``,
    before its first call (a script that calls neither a module nor ``torch.compile`` gives
    no other hook). Only the script's module-level frame is traced, and only until then;
    nothing is installed when a tracer (a debugger, coverage) is already there."""
    import sys

    main = sys.modules.get("__main__")
    if sys.gettrace() is not None or main is None or "__file__" in main.__dict__:
        # A tracer is there already, or the script is already running (the pytest plugin
        # starts recording from inside pytest): its module frame would never be seen, and a
        # tracer left waiting for it would cost every call of the run.
        return False

    def stop(frame: Any) -> None:
        # Only this tracer: one the program installed meanwhile (coverage, a debugger, its own)
        # is the program's, and stays.
        if sys.gettrace() is tracer:
            sys.settrace(None)
        frame.f_trace = None

    def local(frame: Any, event: str, _arg: Any) -> Any:
        try:
            if event == "return" or found():
                stop(frame)
                return None
        except Exception:  # noqa: BLE001 - never into the program
            stop(frame)
            return None
        return local

    script: list[Any] = []  # the script's module code, once its frame started

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        code = frame.f_code
        # The script's own module frame, the first of ``__main__``: not code a decorator
        # exec()s later in its globals (a dataclass's __init__ is made so), whose end is not
        # the script's.
        if event == "call" and code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__" \
                and (not script or code is script[0]):
            script[:] = [code]
            return local
        return None

    sys.settrace(tracer)
    return True
