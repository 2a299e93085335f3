"""Re-run without a factory: the recorded program is its own factory.

When a recording names no factory, ``replay step`` starts the recorded command again (its
``argv``, ``cwd``, executable and numerics environment, from ``attrs["target"]["launch"]``) in
replay mode: ``REPLAY_RERUN`` names a JSON spec, and the injected bootstrap hands over to
``start_in_program`` instead of recording. The program runs as usual up to the first call of the
recorded step callable; that call is taken (its live arguments: the model, the engine), the step
is not run by the program; instead, in the same process, the nearest keyframe and the RNG state
are restored, the catch-up steps and the requested step are run from their recorded inputs and
compared (``rerun_step``), the result is written where the spec says, and the program is
stopped. So the cost is the program's set-up plus the steps from the keyframe, whatever the step
index.

The first call is found by the frame of the step's code (module and qualname), with a profile
hook that is removed once it fires, so it works for functions of the script run as
``__main__``, methods, ``nn.Module`` forwards and functions the program compiles with
``torch.compile`` (which, in replay mode, returns the Python function: the re-run compiles it
again itself in ``--mode compiled``/``cudagraph``, with the arguments the program passed).

One rank of a multi-rank run is started alone: ``init_process_group`` gets a process group that
communicates nothing (torch's fake backend), and the collectives inside re-run steps answer with
what the rank received when recorded.

The program's start-up runs again, so its file writes go to a scratch directory of the re-launch
(``replay.rerun.sandbox``), deleted afterwards; and it is given the stdin it was given when
recorded, when ``replay record`` kept a copy (``stdin.bin``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.errors import CatchUpRaised, RerunError
from replay.format.manifest import STDIN_COPY

if TYPE_CHECKING:
    from replay.rerun.result import StepRerun

__all__ = ["ENV_RERUN", "RelaunchSpec", "needs_relaunch", "recorded_args", "relaunch_step", "start_in_program"]

ENV_RERUN = "REPLAY_RERUN"
_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function's frame (a class body's has it off)
_RECORD_ENV_PREFIX = "REPLAY_RECORD_"
_TIMEOUT_S = float(os.environ.get("REPLAY_RERUN_TIMEOUT", "900"))


@dataclass(kw_only=True, slots=True)
class RelaunchSpec:
    """What the re-launched program is asked to do (written as JSON, read by the bootstrap)."""

    recording: str
    part: str
    rank: int
    step: int
    modes: list[str]
    device: str
    repeat: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    stream: str | None = None  # the model of the part to take (several in one loop)
    keyframe_at: int | None = None  # restore the keyframe at or before this step (bisect: scan from there)
    # Take over the program's call that was this step (the program runs the steps before it
    # itself) and start from its own state there, restoring no keyframe.
    take_at: int | None = None
    out: str = ""  # where the child writes its result JSON
    scratch: str = ""  # where the program's file writes go (replay.rerun.sandbox)


def needs_relaunch(target: dict[str, Any] | None, args: dict[str, Any] | None = None) -> bool:
    """Whether a re-run of this target needs the program itself: no factory, and a step whose
    object (a method's, a module's forward, a function's model argument) only the program makes."""
    if not isinstance(target, dict) or isinstance(target.get("factory"), str):
        return False
    kind = target.get("step_kind")
    if kind in ("method", "module_forward"):
        return True
    if kind == "compiled" and isinstance(target.get("weights"), dict) and target["weights"]:
        return True  # a compiled module (``torch.compile(model)``): its object is an nn.Module the program builds
    module, _, qual = str(target.get("step", "")).partition(":")
    if kind is None and "." in qual:
        return True
    if _in_script(module, target.get("launch")):
        # A function of the script run as __main__: importing it here would run the script's
        # top level (its whole loop) with replay's own argv; the program is its own factory.
        return True
    return any(isinstance(v, dict) for v in (args or {}).values())


def _in_script(module: str, launch: Any) -> bool:
    if module in ("__main__", "__mp_main__"):
        return True
    name = launch.get("main_name") if isinstance(launch, dict) else None
    return isinstance(name, str) and bool(name) and module in (name, name.rsplit(".", 1)[-1])


# -- the parent: `replay step` ---------------------------------------------------------------


def _child_env(launch: dict[str, Any], rank: int, world: int, spec_path: Path) -> dict[str, str]:
    import replay

    env = {k: v for k, v in os.environ.items() if not k.startswith(_RECORD_ENV_PREFIX)}
    # The numerics environment (CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO, ...) as recorded.
    for k, v in (launch.get("env_numerics") or {}).items():
        if v is None:
            env.pop(str(k), None)
        else:
            env[str(k)] = str(v)
    bootstrap = Path(replay.__file__).resolve().parent / "rerun" / "bootstrap"
    package_root = Path(replay.__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap), str(package_root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[ENV_RERUN] = str(spec_path)
    if world > 1:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=env.get("MASTER_PORT", "29555"))
    return env


def _command(exe: str, argv: list[str], launch: dict[str, Any]) -> list[str]:
    """The recorded command line: ``python SCRIPT ARGS``, or ``python -m MODULE ARGS``."""
    opts = [str(o) for o in launch.get("interpreter_options") or [] if isinstance(o, str)]
    if argv[0] == "-c" and isinstance(launch.get("code"), str):
        return [exe, *opts, "-c", launch["code"], *argv[1:]]
    if argv[0] == "-c":
        raise RerunError("the recorded program was `python -c ...`, recorded before its code was kept: pass --factory")
    if argv[0] in ("", "-"):
        raise RerunError("the recorded program was read by python from its stdin (no script to start again): pass --factory")
    name, main_file = launch.get("main_name"), launch.get("main_file")
    # (The interpreter's own options as recorded, -O, -W error, -X ...: they change what runs.)
    if isinstance(name, str) and isinstance(main_file, str) and Path(main_file).stem != name.rsplit(".", 1)[-1] or (
            isinstance(name, str) and "." in name):
        return [exe, *opts, "-m", name, *argv[1:]]
    return [exe, *opts, *argv]


def relaunch_step(spec: RelaunchSpec, launch: dict[str, Any], *, world: int,
                  announce: Any = lambda s: None) -> "StepRerun":
    """Start the recorded command in replay mode; the re-run's result, read back from what the
    program wrote (``StepRerun.to_json()``). Raises RerunError when the program ends without one."""
    cmd, cwd = _launch_command(launch)
    with tempfile.TemporaryDirectory(prefix="replay-relaunch-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec.out = str(Path(tmp) / "result.json")
        spec.scratch = str(Path(tmp) / "scratch")
        os.mkdir(spec.scratch)
        # The program runs elsewhere (its own cwd, and it may chdir): it finds the recording by
        # its absolute path.
        spec.recording = os.path.abspath(spec.recording) if spec.recording else spec.recording
        spec_path.write_text(json.dumps({f: getattr(spec, f) for f in RelaunchSpec.__slots__}))
        # Shown before the program's code runs: the trust gate (replay.trust) goes here too.
        shown = [f"<{c.count(chr(10)) + 1} lines of code>" if i and cmd[i - 1] == "-c" else c for i, c in enumerate(cmd)]
        announce(f"re-launching the recorded program (the recording names no factory): {' '.join(shown)} in {cwd}")
        env = _child_env(launch, spec.rank, world, spec_path)
        from replay.core.environment import env_differences

        moved = env_differences(launch.get("env_digests"), env)
        if moved:
            announce(f"the environment here differs from the recorded program's in {len(moved)} variable(s): "
                     f"{', '.join(moved[:6])}{', ...' if len(moved) > 6 else ''}")
        p, stdin_kept = _run_program(cmd, cwd, env, spec)
        out = Path(spec.out)
        if not out.exists():
            tail = " | ".join((p.stderr or p.stdout or "").strip().splitlines()[-3:])
            others = _other_models(spec.out)
            raise RerunError(f"the re-launched program ended (exit code {p.returncode}) without calling the recorded "
                             + (f"step on the recorded model: it called it on {others}" if others else "step")
                             + "; it cannot be re-run this way" + ("" if stdin_kept or others else _NO_STDIN)
                             + ("" if others else _stdin_from_parent(spec.recording, launch))
                             + (f": {tail}" if tail else ""))
        data = json.loads(out.read_text())
        from replay.rerun.sandbox import count_files

        written = count_files(spec.scratch)
    result = _read_result(data)
    if moved:
        result.env_differences = moved
    if written:
        result.notes.append(f"the re-launched program wrote {written} file(s): they went to a scratch directory, "
                            "deleted now, not to your files")
    return result


# Beside the result file: the number of other models the step was called on (no take-over).
OTHER_MODELS = ".other-models"


def _other_models(out: str) -> str:
    """What the re-launched program said of the models it called the step on that were not the
    recorded one, as a clause ("" for none)."""
    try:
        counts = [_count(int(x)) for x in Path(out + OTHER_MODELS).read_text().split()[:2]]
    except (OSError, ValueError):
        return ""
    shapes, values = (counts + [0, 0])[:2]
    said = []
    if shapes:
        said.append(f"{shapes} model(s) whose parameters (names and shapes) are not the recorded ones")
    if values:
        said.append(f"{values} model(s) with the recorded parameter names and shapes but other values (the program "
                    "built other weights than when recorded: a seed set otherwise, weights initialised in threads that "
                    "race, or another checkpoint)")
    return " and ".join(said)


_NO_STDIN = ("; it may have read its stdin, which the recording did not keep (a terminal, or recorded before "
             "`replay record` kept it): it was given an empty one")


def _stdin_from_parent(recording: str, launch: dict[str, Any]) -> str:
    """Said when the recorded process read another stdin than the command's (a worker the
    program fed through a pipe): the re-launch gives it the command's."""
    from replay.format.manifest import read_manifests

    try:
        command_stdin = read_manifests(Path(recording))[0].get("stdin_id")
    except (OSError, ValueError, IndexError):
        return ""
    mine = launch.get("stdin_id")
    if not isinstance(mine, str) or not isinstance(command_stdin, str) or mine == command_stdin:
        return ""
    return ("; when recorded, its stdin was not the command's but one the program that started it gave it (a pipe "
            "it fed), which `replay record` does not keep: a re-launch gives it the command's. Name a factory "
            "(--factory), or record the worker as a command of its own, its input on its stdin")


def _run_program(cmd: list[str], cwd: str, env: dict[str, str], spec: RelaunchSpec) -> tuple[Any, bool]:
    """Run the re-launched program until it ends or its result is written, given the stdin it
    was recorded with when the recording kept it (else an empty one); (the finished process,
    whether it got that stdin). The process that took the step stops itself once it has written
    the result; the rest of the program (a parent waiting on the worker that took it, on a queue
    that worker was to fill) is stopped after ``_AFTER_RESULT_S``: it would wait forever."""
    stdin = _recorded_stdin(spec.recording)
    result = Path(spec.out)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL if stdin is None else stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        if stdin is not None:
            os.close(stdin)
    deadline = time.monotonic() + _TIMEOUT_S
    stopped_at: float | None = None
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass  # (no output is lost: communicate goes on where it stopped)
            now = time.monotonic()
            if stopped_at is None and result.exists():
                stopped_at = now
            if stopped_at is not None and now - stopped_at > _AFTER_RESULT_S:
                _stop_group(proc)
            elif now > deadline:
                _stop_group(proc)
                proc.communicate()
                raise RerunError(f"the re-launched program did not reach step {spec.step} within {_TIMEOUT_S:.0f} s "
                                 "(REPLAY_RERUN_TIMEOUT sets the limit)")
    finally:
        # Its own workers, started in its session, go with it; and the program itself when
        # replay step stopped first (Ctrl-C).
        running = proc.poll() is None
        _stop_group(proc)
        if running:
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), stdin is not None


_POLL_S = 0.2
# How long the rest of a re-launched program may run on once the step's result is written.
_AFTER_RESULT_S = 3.0


def _stop_group(proc: subprocess.Popen) -> None:
    """Kill the re-launched program's session (its own process group: workers it started too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _recorded_stdin(recording: str) -> int | None:
    """The recording's copy of the program's stdin, opened for the program to read, or None.
    Data only: its bytes are given to the program and never read or run here; a link or anything
    but a regular file (a FIFO that would block) is not taken."""
    if not recording:
        return None
    try:
        fd = os.open(os.path.join(recording, STDIN_COPY), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _launch_command(launch: dict[str, Any]) -> tuple[list[str], str]:
    """The recorded program's command line and working directory, checked to be usable here."""
    argv = [str(a) for a in launch.get("argv") or []]
    exe = launch.get("executable") or sys.executable
    cwd = launch.get("cwd")
    if not argv:
        raise RerunError("the recording names no factory and does not say how the program was started "
                         "(no launch info): pass --factory module:qualname")
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise RerunError(f"the recorded program ran in {cwd!r}, which is not a directory here: "
                         "re-run where it was recorded, or pass --factory")
    if not os.path.exists(exe):
        exe = sys.executable
    return _command(exe, argv, launch), cwd


def _read_result(data: dict[str, Any]) -> "StepRerun":
    """The re-launched program's answer: its re-run, or the error it met, raised here."""
    if data.get("kind") == "error":
        at = data.get("catch_up")
        err = (CatchUpRaised(str(data.get("error")), step=int(at["step"]), keyframe=int(at["keyframe"]))
               if isinstance(at, dict) else RerunError(str(data.get("error"))))
        err.exit_code = int(data.get("exit_code") or RerunError.exit_code)
        raise err
    from replay.rerun.result import StepRerun

    return StepRerun.from_json(data)


# -- the child: inside the re-launched program -----------------------------------------------


def _has_recorded_weights(obj: Any, weights: dict[str, Any], *, by_digest: bool) -> bool:
    """Whether ``obj``'s parameters are the recorded ones: by names and shapes (weights that
    changed since the recording are still this model, and the re-run says which differ); with
    ``by_digest`` (another recorded model has the same names and shapes) by their digests too."""
    from replay.core.weights import weight_digests, weight_shapes

    have = weight_shapes(obj)
    if set(have) != set(weights) or not all(isinstance(weights[n], dict) and have[n] == list(weights[n].get("shape") or []) for n in have):
        return False
    if not by_digest:
        return True
    return all(isinstance(weights.get(n), dict) and weights[n].get("digest") == d.get("digest") for n, d in weight_digests(obj).items())


def _same_architecture_elsewhere(rf: Any, stream: str | None, weights: Any) -> bool:
    """Whether another stream of the rank's part has parameters of the same names and shapes
    as ``weights`` (this stream's recorded ones)."""
    if not isinstance(weights, dict) or not weights:
        return False
    t = rf.attrs.get("target")
    streams = t.get("streams") if isinstance(t, dict) and isinstance(t.get("streams"), dict) else {}

    def layout(w: Any) -> dict[str, Any] | None:
        return {n: (v.get("shape") if isinstance(v, dict) else None) for n, v in w.items()} if isinstance(w, dict) else None

    mine = layout(weights)
    return len(streams) > 1 and any(name != stream and isinstance(other, dict) and layout(other.get("weights")) == mine
               for name, other in streams.items())


def start_in_program() -> None:
    """Called by the bootstrap when ``REPLAY_RERUN`` is set: arm the take-over of the step's
    first call. Never records."""
    path = os.environ.get(ENV_RERUN)
    if not path:
        return None
    spec = RelaunchSpec(**json.loads(Path(path).read_text()))
    _isolate_writes(spec.scratch, os.path.dirname(os.path.abspath(path)))
    from replay.format.reader import Recording

    rec = Recording(spec.recording)
    part = rec[spec.part]
    rf = part[spec.rank]
    from replay.rerun.streams import target_info

    target = target_info(rf, spec.stream)
    _fake_process_group(spec.rank, part.world_size)
    takeover = _Takeover(spec, part, target)
    if part.world_size > 1:
        # What the start-up received from the other ranks (weights, a request), from the recording.
        from replay.rerun.setup_collectives import SetupAnswers

        takeover.setup = SetupAnswers(rf, lambda: takeover.done)
        takeover.setup.install()
    takeover.arm()
    return None


def _isolate_writes(scratch: str, relaunch_dir: str) -> None:
    """Before any of the program's code runs: its file writes go to ``scratch``, not over the
    user's files (its start-up runs again here); the re-launch's own files are written for real.
    A sandbox that cannot start is one line: the program runs on, as before."""
    if not scratch:
        return
    try:
        from replay.rerun.sandbox import install

        install(scratch, keep=[relaunch_dir])
    except Exception as e:  # noqa: BLE001 - never stops the re-launch
        sys.stderr.write(f"replay: the re-launched program's file writes are not redirected: {e.__class__.__name__}: {e}\n")


def _stream_steps_before(rf: Any, step: int | None, stream: str | None) -> int:
    """How many of the rank's steps before ``step`` are the stream's (the program's calls of
    that model's step callable before it)."""
    if not step:
        return 0
    from replay.rerun.streams import stream_of

    return sum(1 for s in range(step) if stream is None or stream_of(rf, s) == stream)


def _count(v: Any) -> int:
    """A small non-negative count from the recording (data only; anything else is 0)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1_000_000 else 0


def _fake_process_group(rank: int, world: int) -> None:
    """``init_process_group`` for one rank alone: a group that communicates nothing."""
    if world <= 1:
        return
    import torch.distributed as dist

    real = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return
        # A program that starts its ranks itself (mp.spawn) starts them all here too: only the
        # rank being re-run goes on; the others stop now (nothing waits for them: the group is fake).
        asked = kwargs.get("rank", args[4] if len(args) > 4 else None)  # (backend, init_method, timeout, world_size, rank)
        if asked is None:
            asked = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None
        if asked is not None and int(asked) not in (-1, rank):
            sys.stdout.flush()
            os._exit(0)
        try:
            from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
        except ImportError as e:
            raise RerunError(f"one rank re-launched alone needs torch's fake process group, not importable here ({e})") from None
        real("fake", store=FakeStore(), rank=rank, world_size=world)

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    import torch.distributed.distributed_c10d as c10d

    c10d.init_process_group = init_process_group  # type: ignore[assignment]


class _Takeover:
    """Finds the step's first call by its frame, and runs the re-run there."""

    def __init__(self, spec: RelaunchSpec, part: Any, target: dict[str, Any]) -> None:
        self.spec = spec
        self.part = part
        self.target = target
        module, _, qual = str(target.get("step", "")).partition(":")
        from replay.rerun.target import StepKind

        self.kind = StepKind.parse(target.get("step_kind"))
        launch = target.get("launch") or {}
        mains = {"__main__", "__mp_main__", str(launch.get("main_name") or "")}
        self.modules = mains if module in mains else {module}
        # A module's forward is named by its class when found with no flags, and as
        # ``Class.forward`` when named with --step.
        forward = self.kind is StepKind.MODULE_FORWARD and not qual.endswith(".forward")
        self.qualname = f"{qual}.forward" if forward else qual
        self.name = self.qualname.rsplit(".", 1)[-1]
        # The class whose instances' forward is the step: it may inherit forward from a base
        # class, whose code (``Base.forward``, perhaps in another module) is the frame's then.
        self.forward_class = self.qualname[: -len(".forward")] if self.kind is StepKind.MODULE_FORWARD else None
        # A compiled step naming a class (``torch.compile(model)``, ``model.compile()``,
        # ``model.forward = torch.compile(model.forward)``): its instances' forward is the step.
        self.class_name = qual if self.kind is StepKind.COMPILED and "." not in qual else None
        self.module_step = False  # the step was taken at a compiled module's forward
        self._forwards: list[Any] = []  # modules whose forward is ours until the first call
        self.compile_kwargs: dict[str, Any] = {}
        self.done = False
        self.setup: Any = None  # SetupAnswers: the start-up's collectives, answered from the recording
        self._real_compile: Any = None
        self._checked: dict[int, tuple[Any, bool]] = {}  # id -> (weak reference, is the recorded model)
        self.other_models = 0  # models the step was called on whose parameters are not the recorded ones
        self.other_values = 0  # ... whose parameters have the recorded names and shapes, other values
        # The part's engine among those the program built one after another (``engine_run``):
        # a new one begins, as when recording, at a new object once the earlier ones are gone.
        self.engine_run = _count(target.get("engine_run"))
        self._run = 0
        self._run_objects: list[Any] = []  # weak references to this run's objects
        self._claim_lock = threading.Lock()
        # Calls of the step the recording missed (discovery chose the step at the first): they
        # run as the program runs them, and the next one is the recording's step 0. With
        # ``take_at``, the program's calls of this stream's steps before that step run too.
        self.skip = _count(target.get("unrecorded_calls")) + _stream_steps_before(part[spec.rank], spec.take_at, spec.stream)
        # Two models of one architecture in the recording (an A/B check of two fine-tunes, a
        # model per worker thread): names and shapes cannot tell them apart, their digests can.
        self.by_digest = _same_architecture_elsewhere(part[spec.rank], spec.stream or target.get("stream"), target.get("weights"))
        # A task pool's worker took whichever task was free: this run's tasks may land on other
        # workers, in another order. The recorded task is found by its model's weights (their
        # digests), in whichever worker and at whichever of its tasks; one of equal weights is as
        # good, its state coming from the recording.
        self.task_pool = bool(launch.get("task_pool")) and isinstance(target.get("weights"), dict) and bool(target.get("weights"))
        if self.task_pool:
            self.by_digest = True
            self.engine_run = 0

    def arm(self) -> None:
        import atexit

        atexit.register(self._say_other_models)
        self._patch_compile()
        sys.setprofile(self._profile)
        # Threads the program starts from now on too: a decode loop may run in a worker thread.
        threading.setprofile(self._profile)

    def _patch_compile(self) -> None:
        """In replay mode torch.compile hands the step function back uncompiled (the re-run
        compiles it itself), so its first call is a Python frame that the profile hook sees."""
        import torch

        real = torch.compile
        me = self
        self._real_compile = real

        def compile(model: Any = None, **kwargs: Any) -> Any:
            if model is None:
                return lambda m: compile(m, **kwargs)
            if me.done:
                # The re-run's own compilation (--mode compiled/cudagraph) must really compile:
                # handing it the Python function back would run eager under a compiled name.
                return real(model, **kwargs)
            module = me._step_module(model)
            if module is not None:
                me.compile_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, (str, bool, int, type(None)))}
                return me.take_forward(module, model)
            code = getattr(model, "__code__", None)
            if code is not None and getattr(code, "co_qualname", code.co_name) == me.qualname:
                me.compile_kwargs = {k: v for k, v in kwargs.items() if isinstance(v, (str, bool, int, type(None)))}
                model._replay_compile_kwargs = dict(me.compile_kwargs)  # noqa: SLF001 - read back below
                return me.first_call(model)
            return real(model, **kwargs)

        torch.compile = compile  # type: ignore[assignment]

    def first_call(self, fn: Any) -> Any:
        """What the program gets back from ``torch.compile(step)``: a function whose first call
        (of the stream's model) is taken over in an ordinary call, not inside the profile hook,
        where tracing is off and the re-run's own torch.compile may not run as it would."""
        import functools
        import inspect

        sig = inspect.signature(fn)
        me = self

        @functools.wraps(fn)
        def step_first_call(*args: Any, **kwargs: Any) -> Any:
            if me.done:
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            live = dict(bound.arguments)
            if not me._is_stream(live):
                return fn(*args, **kwargs)  # another model through the same callable (the draft)
            if not me._in_run(me._object_of(live, next(iter(live), None))):
                return fn(*args, **kwargs)  # an engine built before (or after) the part's own
            me._claim()
            me._take(lambda: me._rerun(fn, live))
            return None  # not reached: _take stops the program

        return step_first_call

    def _step_module(self, model: Any) -> Any:
        """The nn.Module of the recorded class that ``torch.compile`` is given (the module, or
        its bound ``forward``/``_call_impl``), or None."""
        if self.class_name is None:
            return None
        import torch

        module = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
        if not isinstance(module, torch.nn.Module):
            return None
        klass = type(module)
        if klass.__qualname__ != self.class_name or klass.__module__ not in self.modules:
            return None
        return module

    def take_forward(self, module: Any, model: Any) -> Any:
        """What the program gets back from compiling a module of the step's class: the module
        (or its bound method) uncompiled, its ``forward`` replaced until the step's first call,
        which is taken over there, in an ordinary call (the re-run compiles it itself)."""
        import inspect

        forward = type(module).forward
        sig = inspect.signature(forward)
        me = self

        def forward_first_call(*args: Any, **kwargs: Any) -> Any:
            if me.done:
                return forward(module, *args, **kwargs)
            bound = sig.bind(module, *args, **kwargs)
            bound.apply_defaults()
            live = dict(bound.arguments)
            if not me._is_stream(live):
                return forward(module, *args, **kwargs)  # another model of the class (the draft)
            if not me._in_run(module):
                return forward(module, *args, **kwargs)  # an engine built before (or after) the part's own
            me.module_step = True
            me._claim()
            me._take(lambda: me._rerun(forward, live))
            return None  # not reached: _take stops the program

        module.forward = forward_first_call  # an instance attribute: the class is left alone
        self._forwards.append(module)
        return forward_first_call if getattr(model, "__name__", "") == "forward" and model is not module else model

    def _say_other_models(self) -> None:
        """At the program's exit without a take-over: how many models the step was called on
        that were not the recorded one (the parent's error says so)."""
        if not self.done and (self.other_models or self.other_values):
            try:
                Path(self.spec.out + OTHER_MODELS).write_text(f"{self.other_models} {self.other_values}")
            except OSError:
                pass

    def _claim(self) -> None:
        """The first call is ours: no more hooks; the re-run's torch.compile is torch's own."""
        self.done = True
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        for module in self._forwards:
            module.__dict__.pop("forward", None)  # the modules as the program built them
        if self._real_compile is not None:
            import torch

            torch.compile = self._real_compile  # type: ignore[assignment]

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.done:
            return
        code = frame.f_code
        if code.co_name != self.name:
            return
        if not code.co_flags & _CO_OPTIMIZED:
            return  # a class body of that name (a compiled step naming a class), not a call
        first = code.co_varnames[0] if code.co_argcount else None
        if (getattr(code, "co_qualname", code.co_name) != self.qualname or frame.f_globals.get("__name__") not in self.modules) \
                and not self._of_forward_class(frame.f_locals.get(first) if first is not None else None, code):
            return
        if not self._is_stream(frame.f_locals):
            return  # another model of the loop (the draft, say) through the same callable
        if not self._in_run(self._object_of(frame.f_locals, first)):
            return  # an engine the program built before (or after) the part's own
        if not self._is_process():
            self._claim()  # another worker process of the program: it runs as the program runs it
            return
        with self._claim_lock:  # two threads of the program may reach the step at once
            if self.done:
                return
            if self.skip > 0:
                self.skip -= 1
                return  # a call made before the recording's step 0: the program runs it
            self._claim()
        live = dict(frame.f_locals)
        self._take(lambda: self._rerun(self._function(frame, live), live))

    def _of_forward_class(self, obj: Any, code: Any) -> bool:
        """``obj`` is an instance of the step's module class and ``code`` is the forward that
        class runs (one a base class defines, when it inherits it). A base's forward that the
        class's own calls (``super().forward(x)``, ``Base.forward(self, x)``) has the same name
        and object, but its frame is inside the step's: taking it would take the wrong call."""
        if self.forward_class is None or obj is None:
            return False
        klass = type(obj)
        if klass.__qualname__ != self.forward_class or klass.__module__ not in self.modules:
            return False
        fn = getattr(klass, self.name, None)
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)
        while getattr(fn, "__code__", None) is not code and hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__  # the program's own decorators around its forward
        # A forward with no Python code to compare with: which frame is the outer one cannot be
        # told, so any frame of its name on the object is taken.
        return getattr(fn, "__code__", None) is code or not hasattr(fn, "__code__")

    def _is_process(self) -> bool:
        """Whether this is the recorded process among the program's ``multiprocessing`` workers
        (their names are set once they start, so this is asked at the step's call, not at
        start-up). A recording made before the name was kept: any process."""
        want = (self.target.get("launch") or {}).get("process_name")
        if not isinstance(want, str) or self.task_pool:
            return True
        mp = sys.modules.get("multiprocessing")
        return str(mp.current_process().name if mp is not None else "MainProcess") == want

    def _object_of(self, live: dict[str, Any], first: str | None) -> Any:
        """The call's target object, as the recorder took it: the argument holding the model of
        a function step, else the method's own object."""
        from replay.rerun.target import StepKind

        arg = self.target.get("object_arg")
        if isinstance(arg, str) and arg in live:
            return live[arg]
        if first is not None and (self.kind in (StepKind.METHOD, StepKind.MODULE_FORWARD) or "." in self.qualname):
            return live.get(first)
        return None

    def _in_run(self, obj: Any) -> bool:
        """Whether ``obj`` belongs to the part's engine run. The recorder started a new part at a
        new target object once every earlier one had died (a script that builds one engine after
        another, each a part): counted here the same way, at the step's calls."""
        if self.engine_run <= 0:
            return True  # the first run's calls come first: the step is taken among them
        if obj is None:
            return self._run == self.engine_run
        if not any(r() is obj for r in self._run_objects):
            if self._run_objects and all(r() is None for r in self._run_objects):
                self._run += 1
                self._run_objects = []
            self._remember(obj)
        return self._run == self.engine_run

    def _remember(self, obj: Any) -> None:
        import weakref

        try:
            self._run_objects.append(weakref.ref(obj))
        except TypeError:
            pass  # not weak-referenceable: the recorder could not tell its runs apart either

    def _is_stream(self, live: dict[str, Any]) -> bool:
        """Whether this call's object is the recorded model: the one whose parameters are the
        recorded ones, by names and shapes (each object checked once). Another instance of the
        step's class (a draft beside its target, an encoder-decoder's encoder beside its decoder)
        runs as the program runs it."""
        weights = self.target.get("weights")
        if not isinstance(weights, dict) or not weights:
            return True
        import torch

        held = live.get(self.target.get("object_arg")) if isinstance(self.target.get("object_arg"), str) else None
        obj = held if isinstance(held, torch.nn.Module) else next((v for v in live.values() if isinstance(v, torch.nn.Module)), None)
        if obj is None:
            return True
        ref, seen = self._checked.get(id(obj), (None, None))
        if ref is not None and ref() is not obj:
            seen = None  # another object at a freed one's address
        if seen is None:
            seen = _has_recorded_weights(obj, weights, by_digest=self.by_digest)
            try:
                import weakref

                self._checked[id(obj)] = (weakref.ref(obj), seen)
            except TypeError:
                pass
            if not seen and self.by_digest and _has_recorded_weights(obj, weights, by_digest=False):
                self.other_values += 1  # the recorded names and shapes, other values
            elif not seen:
                self.other_models += 1
        return seen

    def _take(self, rerun: Any) -> None:
        """The step's first call: re-run the requested step here, write the result, stop."""
        code = 0
        try:
            data = rerun()
        except Exception as e:  # noqa: BLE001 - reported to the parent as one line, never a traceback
            from replay.errors import ReplayError

            code = e.exit_code if isinstance(e, ReplayError) else RerunError.exit_code
            msg = str(e) if isinstance(e, ReplayError) else f"the re-run raised {e.__class__.__name__}: {e}"
            data = {"kind": "error", "error": msg, "exit_code": code}
            if isinstance(e, CatchUpRaised):
                data["catch_up"] = {"step": e.step, "keyframe": e.keyframe}
        tmp = Path(self.spec.out + f".{os.getpid()}")
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, self.spec.out)  # whole or not at all
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # stop the program: the rest of it is not the re-run's business

    def _rerun(self, fn: Any, live: dict[str, Any]) -> dict[str, Any]:
        from replay.rerun.runner import RerunOptions, rerun_step
        from replay.rerun.target import StepKind, Target, TargetSpec, bound_step, function_step

        rf = self.part[self.spec.rank]
        spec = TargetSpec.from_rank_file(rf, self.spec.stream)
        live = dict(live)
        kind = spec.kind or (StepKind.METHOD if "." in self.qualname else StepKind.FUNCTION)
        obj = self._step_object(fn, live, kind, rf)
        # Compiled again as recorded: the re-launched program may pass torch.compile other
        # arguments (a backend chosen by a variable not set here), which compute otherwise.
        relaunched_kwargs = dict(getattr(fn, "_replay_compile_kwargs", None) or self.compile_kwargs)
        compile_kwargs = dict(spec.compile or relaunched_kwargs)
        other_compile = bool(spec.compile) and bool(relaunched_kwargs) and relaunched_kwargs != dict(spec.compile)
        spec.compile = compile_kwargs
        if compile_kwargs and kind is StepKind.FUNCTION:
            kind = StepKind.COMPILED

        # Each mode starts from its own copy of the objects held by class name only (a run changes
        # them: a cache grows), as the program had them when the step was taken.
        from replay.rerun.runner import LiveObjects

        held = LiveObjects(rf, self.spec.step, live) if len(self.spec.modes) > 1 else None

        def make_target(rp: Any) -> Target:
            if self.module_step:
                # A compiled module's forward: compiled again (bound) in --mode compiled.
                step_fn, ran_as = function_step(fn.__get__(obj, type(obj)), StepKind.COMPILED, spec, rp._compiled())  # noqa: SLF001
            elif kind in (StepKind.METHOD, StepKind.MODULE_FORWARD):
                step_fn, ran_as = bound_step(fn.__get__(obj, type(obj)), spec, rp._compiled())  # noqa: SLF001
            else:
                step_fn, ran_as = function_step(fn, kind, spec, rp._compiled())  # noqa: SLF001
            t = Target(spec, obj, step_fn, rp.device, kind=kind)
            t.own_objects = True
            t.ran_as = ran_as
            t.live_args = held.fresh(live) if held is not None else live
            return t

        settings = RerunOptions(modes=tuple(self.spec.modes), device=self.spec.device, repeat=self.spec.repeat,
                                options=self.spec.options, recording=self.spec.recording, make_target=make_target,
                                spec=spec, stream=self.spec.stream, keyframe_at=self.spec.keyframe_at,
                                live_from=self.spec.take_at or None)
        result = rerun_step(self.part, self.spec.rank, self.spec.step, settings)
        if held is not None and held.uncopied:
            result.notes.append(f"the step's argument {', '.join(held.uncopied)}, held by class name only, could not be "
                                "copied: each mode after the first started from what the one before left in it")
        if self.setup is not None and self.setup.recorded:
            result.notes.append(self.setup.summary() or f"the program's start-up made {self.setup.recorded} collective(s) "
                                f"before the first recorded step: the re-run answered them from the recording")
        if self.task_pool:
            # Another task whose model has the recorded weights is as good only for what the
            # model and the recording hold: a global the task sets (a temperature) is its own.
            result.notes.append("the recorded part ran as a task of a process pool: the re-run took the first call of a task "
                                "whose model has the recorded weights, in whichever worker reached it; a task of equal weights "
                                "that sets other values outside the model (a module global, an argument of its own) computes "
                                "otherwise: where the re-run does not reproduce, record the step with that value as its "
                                "argument, or name the part's task apart (its own weights or seed)")
        if other_compile:
            result.notes.append(f"the re-launched program called torch.compile with {_kwargs_text(relaunched_kwargs)}; "
                                f"compiled again as recorded, with {_kwargs_text(compile_kwargs)}")
        result.notes.append("re-run inside the re-launched program (no factory): its objects at the step's first call, "
                            "state and RNG from the recording" if not self.spec.take_at else
                            "re-run inside the re-launched program (no factory): its objects and state as the program "
                            f"left them at step {self.spec.take_at}'s call, RNG from the recording")
        return result.to_json()

    def _step_object(self, fn: Any, live: dict[str, Any], kind: Any, rf: Any) -> Any:
        """The step's object among the call's live arguments (taken out of ``live``): a method's
        own, else the argument recorded as the target (a function given the model)."""
        import inspect

        from replay.rerun.target import StepKind

        params = list(inspect.signature(fn).parameters)
        if (self.module_step or kind in (StepKind.METHOD, StepKind.MODULE_FORWARD)) and params:
            return live.pop(params[0], None)
        args_json = recorded_args(rf, self.spec.step)
        holder = next((k for k, v in args_json.items() if isinstance(v, dict) and v.get("target")), None)
        return live.get(holder) if holder else None

    def _function(self, frame: Any, live: dict[str, Any]) -> Any:
        """The Python function whose frame this is (not a wrapper around it)."""
        parts = self.qualname.split(".")
        if len(parts) == 1:
            fn = frame.f_globals.get(parts[0])
        else:
            first = next(iter(live.values()), None)  # self (a classmethod's: its class)
            named: Any = frame.f_globals.get(parts[0])  # the class by its qualname (a staticmethod has no self)
            for p in parts[1:-1]:
                named = getattr(named, p, None)
            owners = (type(first) if first is not None else None, first if isinstance(first, type) else None, named)
            fn = None
            for klass in (k for o in owners for k in getattr(o, "__mro__", ())):
                v = vars(klass).get(parts[-1])
                v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v  # the function: _rerun binds it
                if getattr(v, "__qualname__", "") == self.qualname or getattr(v, "__code__", None) is frame.f_code:
                    fn = v  # (an inherited forward: the base class's function, whose frame this is)
                    break
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)
        # The program's callable as it calls it (its own decorators kept), if it leads to this frame.
        inner = fn
        while getattr(inner, "__code__", None) is not frame.f_code and hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
        if getattr(inner, "__code__", None) is not frame.f_code:
            patched = _patched_caller(frame, live, parts[-1])
            if patched is not None:
                return patched
            raise RerunError(f"cannot find the function of {self.qualname} in the re-launched program; if the program "
                             "replaces it with a function of its own (a patched forward), record that function as the "
                             "step: replay record --step MODULE:FUNCTION -- ...")
        return fn


def _patched_caller(frame: Any, live: dict[str, Any], name: str) -> Any:
    """The function the program put in the class's place (``TinyLM.forward = fwd``, ``fwd``
    calling the original): the frame taken is the original's, called by it. The re-run calls
    what the program calls, the patched one; None when the frame's caller is not it."""
    first = next(iter(live.values()), None)
    for klass in getattr(type(first), "__mro__", ()):
        v = vars(klass).get(name)
        if v is not None:
            caller = frame.f_back
            return v if caller is not None and getattr(v, "__code__", None) is caller.f_code else None
    return None


def recorded_args(rf: Any, step: int) -> dict[str, Any]:
    """A step's recorded JSON arguments (which of them is the step's object)."""
    try:
        sid = int(rf.step(step).row["args"])
        args = json.loads(rf.tables.string(sid)) if sid >= 0 else {}
    except (ValueError, KeyError):
        return {}
    return args if isinstance(args, dict) else {}


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()) if v is not None) or "no arguments"
