"""Recording an engine replay has never been told about (tests/engines/tinyllm), with no flags.

The engine is a directory of plain scripts run as ``python generate.py``; these tests check what
a user relies on: the program's output and exit code are unchanged, the step is found and named,
and the recording holds what a re-run needs (launch, numerics context, weights, state, streams).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay import numerics
from replay.format.reader import Recording
from replay.record.calls import NotJSON, module_state, to_json_safe

ENGINE = Path(__file__).resolve().parent / "engines" / "tinyllm"
ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("REPLAY_RECORD_DIR", None)
    env.pop("REPLAY_RECORD_SETTINGS", None)
    return env


def _plain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "generate.py", *args], cwd=ENGINE, env=_env(), capture_output=True, text=True, timeout=timeout)


def _record(out: Path, *args: str, flags: tuple[str, ...] = (), cmd: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = cmd or [sys.executable, "generate.py", *args]
    return subprocess.run(
        [sys.executable, "-m", "replay", "record", "--out", str(out), *flags, "--", *command],
        cwd=ENGINE, env=_env(), capture_output=True, text=True, timeout=timeout,
    )


def _tokens(stdout: str) -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("tokens:")]
    assert len(lines) == 1, stdout
    return lines[0]


def _args(rf, step: int) -> dict:
    sid = int(rf.step(step).row["args"])
    return json.loads(rf.tables.string(sid)) if sid >= 0 else {}


def test_no_flags_finds_the_step_and_records_what_a_rerun_needs(tmp_path: Path) -> None:
    plain = _plain("--tokens", "6")
    r = _record(tmp_path / "rec", "--tokens", "6")
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    assert "step found with no flags: model:Transformer" in r.stderr
    assert "--step MODULE:QUALNAME" in r.stderr
    assert "recorded nothing" not in r.stderr
    with Recording(tmp_path / "rec") as rec:
        assert list(rec) == ["run-000"]
        rf = rec["run-000"][0]
        assert rf.n_steps == 5  # prefill picks the step; the 5 decode steps are recorded
        t = rf.attrs["target"]
        assert t["step"] == "model:Transformer" and t["step_kind"] == "module_forward"
        launch = t["launch"]
        assert launch["main_name"] == "generate"
        assert launch["main_file"] == str(ENGINE / "generate.py")
        assert launch["cwd"] == str(ENGINE) and str(ENGINE) in launch["sys_path"]
        assert launch["argv"][1:] == ["--tokens", "6"]
        assert "CUBLAS_WORKSPACE_CONFIG" in launch["env_numerics"]
        # A dataclass config (the model's own ``config``) is recorded as JSON.
        assert t["config"]["n_layer"] == 2 and t["config_attr"] == "config"
        # Weights: digested per parameter, never in keyframes; state: the KV-cache buffers.
        assert t["weights"]["output.weight"]["shape"] == [96, 32]
        assert len(t["weights"]["output.weight"]["digest"]) == 16
        assert t["state_from"] == "module_buffers"
        _, state = rf.keyframe(0)
        assert "layers.0.attention.kv_cache.k_cache" in state
        assert not set(state) & set(t["weights"])
        # The numerics context of the step: the program's sdpa_kernel(MATH) around decode.
        ctx = numerics.recorded_context(rf, 3)
        assert ctx is not None and ctx["sdpa.math"] is True and ctx["sdpa.flash"] is False
        assert ctx["grad_enabled"] is False
        assert _args(rf, 3)[numerics.NUMERICS_ARG] == numerics.context_digest(ctx)


@pytest.mark.parametrize("step", ["generate:decode_one_token", "__main__:decode_one_token"])
def test_a_function_of_the_script_is_a_step(tmp_path: Path, step: str) -> None:
    r = _record(tmp_path / "rec", "--tokens", "5", flags=("--step", step))
    assert r.returncode == 0, r.stderr
    assert "never ran" not in r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 4
        t = rf.attrs["target"]
        assert t["step"] == "generate:decode_one_token" and t["step_kind"] == "function"
        assert t["object_arg"] == "model"
        args = _args(rf, 0)
        assert args["model"] == {"target": True, "type": "Transformer"}
        assert set(rf.step(0).inputs) == {"x", "input_pos"}


def test_a_named_step_that_never_ran_is_named(tmp_path: Path) -> None:
    r = _record(tmp_path / "rec", "--tokens", "3", flags=("--step", "generate:no_such_function"))
    assert r.returncode == 0
    assert "--step generate:no_such_function never ran" in r.stderr
    assert "replay: recorded " not in r.stderr  # not also "recorded DIR"


def test_nothing_to_find_is_one_honest_line(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import torch\nfor _ in range(3):\n    torch.ones(2) * 2\nprint('ok')\n")
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)])
    assert r.returncode == 0 and r.stdout.strip() == "ok"
    assert "no step found" in r.stderr and "--step MODULE:QUALNAME" in r.stderr
    assert "replay: recorded " not in r.stderr


def test_draft_and_target_are_two_streams_of_one_part(tmp_path: Path) -> None:
    plain = _plain("--tokens", "8", "--draft")
    r = _record(tmp_path / "rec", "--tokens", "8", "--draft")
    assert r.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    with Recording(tmp_path / "rec") as rec:
        assert list(rec) == ["run-000"]
        rf = rec["run-000"][0]
        t = rf.attrs["target"]
        assert set(t["streams"]) == {"draft", "model"}
        assert t["streams"]["draft"]["config"]["n_layer"] == 1 and t["streams"]["model"]["config"]["n_layer"] == 2
        order = [_args(rf, i).get(numerics.STREAM_ARG, t["stream"]) for i in range(rf.n_steps)]
        assert set(order) == {"draft", "model"}
        # Three draft tokens, then one target verification: the order across streams is kept.
        assert order[:5] == ["draft", "draft", "draft", "draft", "model"]
        # The second stream's state is in a keyframe before its first step, under its prefix.
        first_model = order.index("model")
        kf, state = rf.keyframe(first_model)
        assert kf <= first_model and any(k.startswith("model/layers.0.attention.kv_cache") for k in state)


def test_state_dict_as_state_leaves_the_weights_out(tmp_path: Path) -> None:
    r = _record(tmp_path / "rec", "--tokens", "4", flags=("--step", "model:Transformer", "--state", "state_dict"))
    assert r.returncode == 0, r.stderr
    assert "parameters (weights) left out of keyframes" in r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        _, state = rf.keyframe(0)
        weights = set(rf.attrs["target"]["weights"])
        assert state and not set(state) & weights
        assert "layers.0.attention.kv_cache.k_cache" in state


def test_compiled_step_runs_unchanged_and_is_recorded(tmp_path: Path) -> None:
    # Dynamo traces decode_one_token with fullgraph=True (the eager backend skips Inductor's
    # C++ build): any recorder code on the traced path would fail the program.
    args = ("--tokens", "5", "--compile", "--compile-backend", "eager")
    plain = _plain(*args)
    r = _record(tmp_path / "rec", *args)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    assert "step found with no flags: generate:decode_one_token (a torch.compile'd callable" in r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 4
        t = rf.attrs["target"]
        assert t["step"] == "generate:decode_one_token" and t["step_kind"] == "compiled"
        assert t["object_arg"] == "model" and t["weights"]


def test_a_module_step_inside_compiled_code_is_recorded_at_the_boundary(tmp_path: Path) -> None:
    args = ("--tokens", "5", "--compile", "--compile-backend", "eager")
    r = _record(tmp_path / "rec", *args, flags=("--step", "model:Transformer"))
    assert r.returncode == 0, r.stderr
    assert "--step model:Transformer runs inside torch.compile'd generate:decode_one_token" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inductor_compiled_step_runs_unchanged_and_is_recorded(tmp_path: Path) -> None:
    args = ("--tokens", "4", "--compile")
    plain = _plain(*args, timeout=550)
    r = _record(tmp_path / "rec", *args, timeout=550)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    with Recording(tmp_path / "rec") as rec:
        assert rec["run-000"][0].attrs["target"]["step_kind"] == "compiled"


def test_tensor_parallel_under_torchrun(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "generate.py", "--tokens", "4"]
    plain = subprocess.run(cmd, cwd=ENGINE, env=_env(), capture_output=True, text=True, timeout=300)
    r = _record(tmp_path / "rec", cmd=cmd)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    with Recording(tmp_path / "rec") as rec:
        (part,) = rec.values()
        assert sorted(part) == [0, 1]
        for rank in (0, 1):
            assert part[rank].n_steps == 3
            assert part[rank].attrs["target"]["step"] == "model:Transformer"
        assert part[0].full().collectives.size > 0  # the hook all-reduces


def test_configs_become_json() -> None:
    import argparse
    import enum
    from dataclasses import dataclass
    from types import SimpleNamespace

    class Mode(enum.Enum):
        FAST = "fast"

    @dataclass
    class Cfg:
        path: Path
        shape: tuple[int, int]
        mode: Mode
        dtype: torch.dtype
        extra: SimpleNamespace

    got = to_json_safe(Cfg(Path("/w/ckpt"), (2, 3), Mode.FAST, torch.bfloat16, SimpleNamespace(k=1)))
    assert got == {"path": "/w/ckpt", "shape": [2, 3], "mode": "fast", "dtype": "torch.bfloat16", "extra": {"k": 1}}
    assert json.loads(json.dumps(got)) == got
    assert to_json_safe(argparse.Namespace(a=1)) == {"a": 1}
    with pytest.raises(NotJSON):
        to_json_safe({"w": torch.zeros(1)})


def test_module_state_is_buffers_and_tensor_attributes_not_parameters() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("kv", torch.zeros(3))
            self.pos = torch.zeros(1, dtype=torch.long)

    st = module_state(M())
    assert set(st) == {"kv", "pos"}


def test_a_bad_pyproject_value_is_one_line_before_the_program_runs(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.replay]\ndurability = "sync"\n')
    r = subprocess.run([sys.executable, "-m", "replay", "record", "--out", str(tmp_path / "rec"), "--", sys.executable, "-c", "print('ran')"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert "[tool.replay]" in r.stderr and "durability = 'sync' is not one of: step, async" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_settings_in_the_environment_never_break_the_program(tmp_path: Path) -> None:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "replay" / "record" / "bootstrap"), env["PYTHONPATH"]])
    env["REPLAY_RECORD_DIR"] = str(tmp_path / "rec")
    env["REPLAY_RECORD_SETTINGS"] = json.dumps({"durability": "sync"})
    r = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ran"
    assert r.stderr.count("\n") == 1 and "recording disabled" in r.stderr and "durability" in r.stderr


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_reduce_overhead_compiled_step_on_cuda_is_recorded_with_its_graphs(tmp_path: Path) -> None:
    # Unvalidated on CPU-only machines: written for `make test-gpu` (an H200).
    args = ("--tokens", "10", "--compile", "--compile-mode", "reduce-overhead", "--device", "cuda")
    plain = _plain(*args, timeout=550)
    r = _record(tmp_path / "rec", *args, timeout=550)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout)
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        t = rf.attrs["target"]
        assert t["step_kind"] == "compiled" and t["device"].startswith("cuda")
        assert rf.n_steps == 9
        modes = [rf.step(i).mode for i in range(rf.n_steps)]
        assert "graph" in modes, modes  # CUDA graph trees replay after their warm-up calls


COMPILED_MODULE = """
import torch
torch.manual_seed(0)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.register_buffer("kv", torch.zeros(4))
    def forward(self, x):
        self.kv.add_(1)
        return self.l(x) + self.kv
m = M()
cm = torch.compile(m, fullgraph=True, backend="eager")
x = torch.ones(1, 4)
with torch.no_grad():
    for _ in range(3):
        x = cm(x)
print("ok", float(x.sum()))
"""


def test_a_compiled_module_is_recorded_at_its_boundary(tmp_path: Path) -> None:
    script = tmp_path / "cmod.py"
    script.write_text(COMPILED_MODULE)
    plain = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=300)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)])
    assert r.returncode == plain.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    assert "step found with no flags: cmod:M (a torch.compile'd callable, 3 calls recorded)" in r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        t = rf.attrs["target"]
        assert rf.n_steps == 3 and t["step"] == "cmod:M" and t["step_kind"] == "compiled"
        assert set(t["weights"]) == {"l.weight", "l.bias"}
        _, state = rf.keyframe(0)
        assert {k for k in state if not k.startswith("__")} == {"kv"}  # (and the reserved Python-state names)


CONTEXT_SWITCH = """
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

def attend(q, pos: int):
    return F.scaled_dot_product_attention(q, q, q) + pos

q = torch.ones(1, 1, 2, 4)
for i in range(4):
    if i < 2:
        attend(q, i)
    else:
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            attend(q, i)
print("ok")
"""


def test_each_step_names_the_numerics_context_it_ran_under(tmp_path: Path) -> None:
    script = tmp_path / "ctx.py"
    script.write_text(CONTEXT_SWITCH)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)], flags=("--step", "ctx:attend"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 4
        first, later = numerics.recorded_context(rf, 0), numerics.recorded_context(rf, 3)
        assert first is not None and later is not None
        assert numerics.recorded_context(rf, 1) == first
        assert first["sdpa.flash"] is True and first["grad_enabled"] is True
        assert later["sdpa.flash"] is False and later["grad_enabled"] is False
        assert len(rf.attrs["target"]["numerics"]["contexts"]) == 2
        lines = numerics.differences(later, first)
        assert "grad_enabled: recorded false, now true" in lines
        assert _args(rf, 2)["pos"] == 2  # the step's own arguments are kept beside the digest


KEPT_SETTING = """
import torch

def step(x):
    torch.backends.cuda.matmul.allow_tf32 = True  # set by the step itself, and kept
    return x + 1

torch.backends.cuda.matmul.allow_tf32 = False
for i in range(3):
    step(torch.ones(2))
print("ok")
"""


def test_a_setting_the_step_changes_and_keeps_is_recorded_for_that_step(tmp_path: Path) -> None:
    """The context is read when the call returns: what the step's own kernels ran under."""
    script = tmp_path / "kept.py"
    script.write_text(KEPT_SETTING)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)], flags=("--step", "kept:step"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 3
        assert all(numerics.recorded_context(rf, s)["backends.cuda.matmul.allow_tf32"] is True for s in range(3))
        assert len(rf.attrs["target"]["numerics"]["contexts"]) == 1


TERMINATED_IN_A_STEP = """
import os, signal, time
import torch

def step(x):
    if x[0].item() == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # the program is ended while inside this step
        time.sleep(3)
    return x + 1

step(torch.zeros(2))
step(torch.ones(2))
with torch.no_grad():  # a context no earlier step ran under
    step(torch.full((2,), 2.0))
"""


def test_a_step_still_running_when_the_program_is_terminated_names_its_context(tmp_path: Path) -> None:
    """The context is read when a call returns; a step that never returns (SIGTERM inside it)
    has it read when recording closes."""
    script = tmp_path / "term.py"
    script.write_text(TERMINATED_IN_A_STEP)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)], flags=("--step", "term:step"))
    assert r.returncode != 0
    with Recording(tmp_path / "rec") as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 3
        last = numerics.recorded_context(rf, 2)
        assert last is not None and last["grad_enabled"] is False
        assert numerics.recorded_context(rf, 0)["grad_enabled"] is True
        assert len(rf.attrs["target"]["numerics"]["contexts"]) == 2


PART_FROM_ANOTHER_THREAD = """
import threading, time
import torch

def f(x):
    time.sleep(0.8)
    return x + 1

def g(x):
    if x[0].item() == 0:
        time.sleep(1.2)
    return x * 2

f(torch.zeros(2))
ta = threading.Thread(target=f, args=(torch.ones(2),))
ta.start()
time.sleep(0.2)
for i in range(3):
    g(torch.full((2,), float(i)))  # another step: a new part, begun while f's step runs
ta.join()
"""


def test_a_part_begun_while_another_threads_step_runs_names_its_own_contexts(tmp_path: Path) -> None:
    script = tmp_path / "thr.py"
    script.write_text(PART_FROM_ANOTHER_THREAD)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script)], flags=("--step", "thr:f", "--step", "thr:g"))
    assert r.returncode == 0, r.stderr
    with Recording(tmp_path / "rec") as rec:
        for part in ("run-000", "run-001"):
            rf = rec[part][0]
            assert rf.n_steps >= 2, part
            assert len(rf.attrs["target"]["numerics"]["contexts"]) == 1, part
            assert all(numerics.recorded_context(rf, s) is not None for s in range(rf.n_steps)), part


def test_a_failure_of_the_recorder_around_a_step_stops_recording_and_the_step_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    import inspect

    from replay.record import session as session_mod
    from replay.record.profiles import StepSpec
    from replay.record.settings import RecordSettings

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("recorder bug")

    s = session_mod.Session(tmp_path, RecordSettings())
    monkeypatch.setattr(session_mod, "split_arguments", boom)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    spec = StepSpec(step="t:f", kind="function")
    for _ in range(2):
        out = s._call_step(spec, f, inspect.signature(f), False, (torch.ones(2),), {})
        assert torch.equal(out, torch.full((2,), 2.0))
    assert s.disabled
    assert capfd.readouterr().err.count("recording stopped: RuntimeError: recorder bug") == 1


def test_a_call_whose_step_could_not_begin_is_not_counted_as_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that found no step open, and whose step then could not begin (another thread began
    one in between, or the recorder refused it), ran unrecorded: `replay record`'s "N calls
    recorded" counted it (9 calls recorded, 8 steps in the recording, two threads decoding)."""
    import inspect

    from replay.record import session as session_mod
    from replay.record.profiles import StepSpec
    from replay.record.recorder import Recorder
    from replay.record.settings import RecordSettings

    s = session_mod.Session(tmp_path, RecordSettings())
    begin = Recorder.begin_step
    calls = {"n": 0}

    def begin_once_refused(self: Recorder, **kw: object) -> int:
        calls["n"] += 1
        return -1 if calls["n"] == 2 else begin(self, **kw)

    monkeypatch.setattr(Recorder, "begin_step", begin_once_refused)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    spec = StepSpec(step="t:f", kind="function")
    for _ in range(4):
        out = s._call_step(spec, f, inspect.signature(f), False, (torch.ones(2),), {})
        assert torch.equal(out, torch.full((2,), 2.0))
    s.close_recorder()
    assert s.report()["recorded"] == {"t:f": 3}
    with Recording(tmp_path) as rec:
        assert rec["run-000"][0].n_steps == 3


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.proj(x) * scale


def test_replays_of_a_graph_captured_around_a_module_call_are_its_steps(tmp_path: Path) -> None:
    """A program that captures its decode step in a CUDA graph and then only replays it: with no
    step named, each replay is a step of the captured module (static inputs as filled, static
    outputs as written). On the CPU a stand-in graph class goes through the same wrappers."""
    import types

    from replay.digest import digest
    from replay.format.reader import Recording
    from replay.record import cuda_graphs
    from replay.record import session as session_mod
    from replay.record.settings import RecordSettings

    model = _Linear().eval()

    class FakeGraph:
        """capture_begin/capture_end around a module call; replay recomputes the static output."""

        def capture_begin(self, *args: object, **kwargs: object) -> None:
            pass

        def capture_end(self) -> None:
            pass

        def pool(self) -> tuple[int, int]:
            return (0, 0)

        def replay(self) -> None:
            with torch.no_grad():
                torch.mul(torch.nn.functional.linear(static_x, model.proj.weight, model.proj.bias), 2.0, out=static_out)

    s = session_mod.Session(tmp_path, RecordSettings(cuda_graph_kernels=False))
    cuda_graphs.install(s, types.SimpleNamespace(CUDAGraph=FakeGraph))
    static_x = torch.zeros(1, 4)
    g = FakeGraph()
    with torch.no_grad():
        g.capture_begin()
        static_out = model(static_x, scale=2.0)
        g.capture_end()
    expected = []
    for i in range(3):
        static_x.copy_(torch.full((1, 4), float(i)))
        assert g.replay() is None  # what the program gets back is untouched
        expected.append(static_out.clone())
    s.close_recorder()
    assert [c["kind"] for c in s.report()["chosen"]] == ["cuda_graph"]
    with Recording(tmp_path) as rec:
        rf = rec["run-000"][0]
        assert rf.n_steps == 3
        t = rf.attrs["target"]
        assert t["step"].endswith(":_Linear") and t["step_kind"] == "module_forward"
        for i in range(3):
            view = rf.step(i)
            assert torch.equal(view.inputs["x"], torch.full((1, 4), float(i)))
            assert _args(rf, i)["scale"] == 2.0
            assert dict(view.fields())["output.logits"] == digest(expected[i])  # what the replay wrote
    from replay.record.discovery import summary_lines

    line = summary_lines([s.report()])[0]
    assert "replays of a CUDA graph the program captured around this nn.Module's call, 3 calls recorded" in line


def test_summary_lines_say_what_was_chosen_and_what_could_not_be_seen() -> None:
    from replay.record.discovery import summary_lines

    wrapper = [{"rank": 0, "world": 1, "named": [], "ran": {"nets:TinyLM": 16},
                "chosen": [{"step": "nets:TinyLM", "kind": "module_forward", "inside": "nets:SpeculativeEngine"}], "seen": {}}]
    assert summary_lines(wrapper) == [
        "replay: step found with no flags: nets:TinyLM (the nn.Module called repeatedly inside nets:SpeculativeEngine,"
        " which runs the loop, 16 calls recorded); to record another callable: replay record --step MODULE:QUALNAME -- ..."]
    tp = [{"rank": r, "world": 2, "named": [], "ran": {"g:step": 4}, "chosen": [{"step": "g:step", "kind": "compiled"}], "seen": {}}
          for r in range(2)]
    lines = summary_lines(tp)
    assert len(lines) == 2 and "g:step ran compiled on 2 ranks: collectives inside it run inside its graph" in lines[1]
    assert len(summary_lines([{**tp[0], "world": 1}])) == 1  # one rank: no collectives to miss
    nothing = [{"rank": 0, "named": [], "ran": {}, "chosen": [], "seen": {"m:A": 3, "m:B": 1}}]
    assert summary_lines(nothing) == ["replay: no step found; outermost nn.Module calls seen: m:A (3), m:B (1);"
                                      " name the step with --step MODULE:QUALNAME"]
    never = [{"rank": 0, "named": ["m:f"], "ran": {}, "chosen": [], "seen": {}}]
    assert summary_lines(never) == ["replay: --step m:f never ran: no call of it was seen (check the module and qualname)"]
    # Chosen in the parent, run in a forked child that left through os._exit (no report): the
    # recording holds 8 steps, so the line never says the step did not run again.
    forked = [{"rank": 0, "named": [], "ran": {}, "chosen": [{"step": "loop:LM", "kind": "module_forward"}], "seen": {"loop:LM": 1}}]
    assert "never ran again" in summary_lines(forked)[0]
    line = summary_lines(forked, recorded_steps=8)[0]
    assert line.startswith("replay: step found with no flags: loop:LM (the outermost nn.Module's forward, 8 steps in the "
                           "recording, from its second call: the first, which revealed it, ran unrecorded); recorded by a "
                           "process that ended without reporting (os._exit"), line


JIT_PROGRAM = """
import sys, torch
torch.manual_seed(0)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.l(x).tanh()
m = M().eval()
m = torch.jit.script(m) if sys.argv[1] == "script" else torch.jit.trace(m, torch.ones(1, 8))
x = torch.ones(1, 8)
with torch.no_grad():
    for _ in range(5):
        x = m(x)
print("ok", float(x.sum()))
"""


@pytest.mark.parametrize("how", ["trace", "script"])
def test_a_jit_traced_or_scripted_model_runs_unchanged_and_nothing_is_claimed(tmp_path: Path, how: str) -> None:
    """torch.jit.trace calls the module to build its graph: the recorder must not be traced into
    it (the program used to crash in the trace check), and a step it cannot see is not claimed."""
    script = tmp_path / "jitprog.py"
    script.write_text(JIT_PROGRAM)
    plain = subprocess.run([sys.executable, str(script), how], env=_env(), capture_output=True, text=True, timeout=300)
    r = _record(tmp_path / "rec", cmd=[sys.executable, str(script), how])
    assert r.returncode == plain.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr and "cannot record" not in r.stderr, r.stderr
    assert "step found with no flags" not in r.stderr
    assert "replay: no step" in r.stderr
    # The scripted or traced model is named as TorchScript, with what to name instead of it (the
    # Python module torch.jit.trace ran to check its trace is not a candidate).
    assert "is TorchScript (torch.jit.script or trace)" in r.stderr and "--step MODULE:FUNCTION" in r.stderr, r.stderr
