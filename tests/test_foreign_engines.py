"""Engines nobody here wrote the recorder for, recorded with no flags: the whole path a new user takes.

Three engines of different shapes (tests/engines/README.md): ``gptgen`` (a Generator class whose
``decode_step`` calls the model with a KV cache list it owns, top-k sampling), ``hfloop`` (an HF
style loop: ``past_key_values`` a tuple of tuples made anew every step, a dataclass output,
bfloat16 autocast) and ``specwrap`` (a wrapper module whose forward runs the whole loop, target
and draft of one class, ``torch.compile`` on the modules). For each: ``replay record -- python
generate.py`` with no flags leaves the output and exit code alone and says which step it chose;
``info``, ``step`` (from another directory), ``bisect steps`` and ``report`` make sense of it.
Plus tinyllm tensor-parallel under torchrun with ``--compile`` (the recorder's collective
wrappers under Dynamo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ENGINES = Path(__file__).resolve().parent / "engines"
ROOT = Path(__file__).resolve().parent.parent

# name: (engine, program arguments, its exit code)
VARIANTS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "gptgen": ("gptgen", ("--tokens", "8"), 0),
    "hfloop": ("hfloop", ("--tokens", "8"), 0),
    "hfloop_tuple_exit3": ("hfloop", ("--tokens", "6", "--tuple", "--exit-code", "3"), 3),
    "hfloop_compile_forward": ("hfloop", ("--tokens", "6", "--compile", "forward", "--compile-backend", "eager"), 0),
    "hfloop_compile_method": ("hfloop", ("--tokens", "6", "--compile", "method", "--compile-backend", "eager"), 0),
    "specwrap": ("specwrap", (), 0),
    "specwrap_compiled": ("specwrap", ("--compile", "--compile-backend", "eager"), 0),
}

FOUND = {
    "gptgen": "step found with no flags: model:GPT (the outermost nn.Module's forward",
    "hfloop": "step found with no flags: modeling:TinyForCausalLM (the outermost nn.Module's forward",
    "hfloop_tuple_exit3": "step found with no flags: modeling:TinyForCausalLM",
    "hfloop_compile_forward": "step found with no flags: modeling:TinyForCausalLM (a torch.compile'd callable, 6 calls recorded)",
    "hfloop_compile_method": "step found with no flags: modeling:TinyForCausalLM (a torch.compile'd callable, 6 calls recorded)",
    "specwrap": ("step found with no flags: nets:TinyLM (the nn.Module called repeatedly inside nets:SpeculativeEngine,"
                 " which runs the loop"),
    "specwrap_compiled": "step found with no flags: nets:TinyLM (a torch.compile'd callable",
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
    env["PYTHONPATH"] = str(ROOT)  # replay itself; never an engine's directory
    return env


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _replay(*args: Any, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _target(rec: Path) -> dict[str, Any]:
    from replay.format.reader import Recording

    with Recording(rec) as r:
        return dict(r["run-000"][0].attrs["target"])


def _step_args(rec: Path, step: int) -> tuple[dict[str, Any], list[str]]:
    from replay.format.reader import Recording

    with Recording(rec) as r:
        rf = r["run-000"][0]
        sid = int(rf.step(step).row["args"])
        return (json.loads(rf.tables.string(sid)) if sid >= 0 else {}), sorted(rf.step(step).inputs)


def _tokens(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("tokens:")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every variant recorded once with no flags, next to a plain run of it."""
    base = tmp_path_factory.mktemp("foreign-engines")
    jobs = {}
    for name, (engine, args, _) in VARIANTS.items():
        cmd = [sys.executable, "generate.py", *args]
        jobs[name] = (_start(cmd, ENGINES / engine),
                      _start([sys.executable, "-m", "replay", "record", "--out", str(base / name), "--", *cmd], ENGINES / engine))
    out: dict[str, Any] = {"cwd": base / "elsewhere"}
    (base / "elsewhere").mkdir()
    for name, (plain, recorded) in jobs.items():
        p_out, p_err = plain.communicate(timeout=600)
        r_out, r_err = recorded.communicate(timeout=600)
        out[name] = {"rec": base / name, "plain": (plain.returncode, p_out, p_err), "recorded": (recorded.returncode, r_out, r_err)}
    return out


@pytest.mark.e2e
@pytest.mark.smoke
def test_hf_style_loop_is_recorded_with_no_flags_and_its_cache_kept(tmp_path: Path) -> None:
    engine = ENGINES / "hfloop"
    plain = subprocess.run([sys.executable, "generate.py", "--tokens", "4"], cwd=engine, env=_env(), capture_output=True, text=True, timeout=300)
    r = _replay("record", "--out", tmp_path / "rec", "--", sys.executable, "generate.py", "--tokens", "4", cwd=engine, timeout=300)
    assert r.returncode == plain.returncode == 0, r.stderr
    assert _tokens(r.stdout) == _tokens(plain.stdout) and len(_tokens(plain.stdout)) == 1
    assert FOUND["hfloop"] in r.stderr
    t = _target(tmp_path / "rec")
    assert t["step"] == "modeling:TinyForCausalLM" and t["step_kind"] == "module_forward"
    assert t["config"]["hidden_size"] == 32  # the model's dataclass config, as data
    # Step 1 is a decode step: the cache (a tuple of per-layer (k, v) tuples) is recorded tensor by
    # tensor, with its shape, so that a re-run can hand the model the same tuple.
    args, inputs = _step_args(tmp_path / "rec", 1)
    assert {"input_ids", "attention_mask", "past_key_values.0.0", "past_key_values.1.1"} <= set(inputs)
    structure = args["__structure__"]["past_key_values"]
    assert structure["type"] == "tuple" and structure["items"][0] == {"type": "tuple", "items": ["tensor", "tensor"]}
    assert args["use_cache"] is True and "unrecorded" not in json.dumps(args)
    info = _replay("info", tmp_path / "rec", "--json", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["ranks"][0]["steps"] == 3 and data["streams"] == [] and data["first_divergence"] is None


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_program_runs_as_without_replay_and_its_step_is_named(runs: dict[str, Any], name: str) -> None:
    p_code, p_out, _ = runs[name]["plain"]
    r_code, r_out, r_err = runs[name]["recorded"]
    assert p_code == VARIANTS[name][2]
    assert r_code == p_code, r_err[-3000:]
    assert _tokens(r_out) == _tokens(p_out) and len(_tokens(p_out)) == 1, (r_out, p_out)
    assert FOUND[name] in r_err, r_err[-3000:]
    assert "to record another callable: replay record --step MODULE:QUALNAME" in r_err
    assert "Traceback" not in r_err and "UserWarning" not in r_err, r_err[-3000:]
    assert f"(command exit code {p_code})" in r_err


@pytest.mark.e2e
def test_a_wrapper_module_that_runs_the_loop_gives_way_to_its_models_as_streams(runs: dict[str, Any]) -> None:
    for name in ("specwrap", "specwrap_compiled"):
        t = _target(runs[name]["rec"])
        assert t["step"] == "nets:TinyLM"
        assert set(t["streams"]) == {"target", "draft"}, name  # named by the program's own variables
        info = _replay("info", runs[name]["rec"], "--json", cwd=runs["cwd"])
        assert info.returncode == 0, info.stderr
        streams = {s["stream"]: s for s in json.loads(info.stdout)["streams"]}
        assert set(streams) == {"target", "draft"}
        total = json.loads(info.stdout)["ranks"][0]["steps"]
        assert streams["target"]["steps"] + streams["draft"]["steps"] == total
        assert streams["draft"]["steps"] == 2 * streams["target"]["steps"] - (2 if name == "specwrap" else 0)
        text = _replay("info", runs[name]["rec"], cwd=runs["cwd"]).stdout
        assert "streams     2 models in one loop" in text and "one rank: nothing to compare across ranks" in text


@pytest.mark.e2e
def test_tuple_outputs_name_their_logits(runs: dict[str, Any]) -> None:
    """``return_dict=False``: ``(logits, past_key_values)``; the logits are named so (margins)."""
    from replay.format.reader import Recording

    with Recording(runs["hfloop_tuple_exit3"]["rec"]) as r:
        rf = r["run-000"][0]
        assert "output.logits" in dict(rf.step(0).fields())
        assert rf.n_steps == 5


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["hfloop_compile_forward", "hfloop_compile_method"])
def test_a_compiled_module_call_is_the_modules_step_with_its_object(runs: dict[str, Any], name: str) -> None:
    """``m.forward = torch.compile(m.forward)`` and ``m.compile()``: the module's step, every call
    recorded (prefill included), with the module as its object (weights digested)."""
    t = _target(runs[name]["rec"])
    assert t["step"] == "modeling:TinyForCausalLM" and t["step_kind"] == "compiled"
    assert len(t["weights"]) == 28 and t["compile"]["backend"] == "eager" and t["compile"]["dynamic"] is True
    _, inputs = _step_args(runs[name]["rec"], 1)
    assert "past_key_values.0.0" in inputs


@pytest.mark.e2e
def test_torch_compile_arguments_are_recorded(runs: dict[str, Any]) -> None:
    t = _target(runs["specwrap_compiled"]["rec"])
    assert t["step_kind"] == "compiled"
    for stream in ("target", "draft"):
        assert t["streams"][stream]["compile"] == {"backend": "eager", "dynamic": False, "fullgraph": False, "mode": None}
    assert _target(runs["specwrap"]["rec"])["compile"] == {}


def _step(runs: dict[str, Any], name: str, step: int) -> tuple[int, dict[str, Any] | None, str]:
    p = _replay("step", runs[name]["rec"], "--rank", 0, "--step", step, "--json", "--no-save", cwd=runs["cwd"])
    try:
        return p.returncode, json.loads(p.stdout), p.stderr
    except ValueError:
        return p.returncode, None, p.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("name, step", [
    ("gptgen", 5),
    ("hfloop", 4),
    ("specwrap", 9),
    ("specwrap_compiled", 9),
    ("hfloop_compile_forward", 3),
    ("hfloop_compile_method", 3),
])
def test_a_step_reruns_bit_for_bit_from_another_directory(runs: dict[str, Any], name: str, step: int) -> None:
    code, data, err = _step(runs, name, step)
    assert code == 0, err[-3000:]
    assert data is not None and data["problem"] is None
    eager = data["modes"]["eager"]
    assert eager["error"] is None and eager["departed"] is None, eager
    assert eager["vs_recording"] and all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    if _target(runs[name]["rec"])["step_kind"] == "compiled":
        # Compiled again inside the re-launched program (a compiled module: its forward).
        compiled = data["modes"]["compiled"]
        assert compiled["error"] is None and compiled["ran_as"].startswith("torch.compile("), compiled


@pytest.mark.e2e
def test_a_step_never_rerun_as_equal_when_the_cache_is_not_rebuilt(runs: dict[str, Any]) -> None:
    """Whatever the re-run side does with the HF cache, it never calls a departed step equal."""
    code, data, err = _step(runs, "hfloop", 4)
    if code == 0:
        eager = data["modes"]["eager"]
        assert eager["departed"] is None and all(v["verdict"] == "bitwise equal" for v in eager["vs_recording"].values())
    else:
        assert code != 0 and "Traceback" not in err and err.strip(), err


@pytest.mark.e2e
def test_bisect_steps_against_the_rerun_finds_nothing_on_an_unchanged_engine(runs: dict[str, Any]) -> None:
    p = _replay("bisect", "steps", runs["gptgen"]["rec"], "--against-rerun", "--rank", 0, "--no-save", cwd=runs["cwd"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 0 re-run eager: no departure from the recording found" in p.stdout, p.stdout
    assert "re-run inside the re-launched program (no factory)" in p.stdout and "(from not found)" not in p.stderr


@pytest.mark.e2e
def test_bisect_steps_across_ranks_of_one_rank_says_why_not(runs: dict[str, Any]) -> None:
    p = _replay("bisect", "steps", runs["gptgen"]["rec"], cwd=runs["cwd"])
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "needs two or more" in p.stderr and "--against-rerun" in p.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["gptgen", "hfloop", "specwrap"])
def test_report_of_one_rank_makes_no_verdict_across_ranks(runs: dict[str, Any], name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.html"
    p = _replay("report", runs[name]["rec"], "-o", out, cwd=runs["cwd"])
    assert p.returncode == 0, p.stderr
    html = out.read_text()
    assert "No divergence" not in html and "One rank</b>: nothing to compare across ranks" in html
    assert f"replay step {runs[name]['rec']} --rank 0 --step" in html and "--mode both" not in html
    if name == "specwrap":
        assert "2 models in one loop" in html and "<td>target</td>" in html and "<td>draft</td>" in html


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_tensor_parallel_compiled_under_torchrun_runs_and_is_recorded(tmp_path: Path) -> None:
    engine = ENGINES / "tinyllm"
    args = ["--tokens", "5", "--compile", "--compile-backend", "eager"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "generate.py", *args]  # a free port each: the plain run goes at the same time
    plain = _start(cmd, engine)
    r = _replay("record", "--out", tmp_path / "rec", "--", *cmd, cwd=engine)
    p_out, _ = plain.communicate(timeout=600)
    assert r.returncode == plain.returncode == 0, r.stderr[-3000:]
    assert _tokens(r.stdout) == _tokens(p_out) and len(_tokens(p_out)) == 1
    assert "step found with no flags: generate:decode_one_token (a torch.compile'd callable" in r.stderr
    # Its hook all-reduces ran inside the compiled graph: the recorder says it did not see them.
    assert "generate:decode_one_token ran compiled on 2 ranks: collectives inside it run inside its graph" in r.stderr
    info = _replay("info", tmp_path / "rec", "--json", cwd=tmp_path)
    data = json.loads(info.stdout)
    assert data["world_size"] == 2 and [x["steps"] for x in data["ranks"]] == [4, 4]
    assert all(x["raised_steps"] == 0 and x["complete"] for x in data["ranks"])
    assert data["first_divergence"] is None  # two ranks compared: TP ranks share their outputs
    t = _target(tmp_path / "rec")
    assert t["compile"] == {"backend": "eager", "dynamic": None, "fullgraph": True, "mode": None}
    # One rank re-run alone cannot be fed the collectives the graph ran: it says why.
    step = _replay("step", tmp_path / "rec", "--rank", 1, "--step", 2, "--no-save", cwd=tmp_path)
    assert step.returncode != 0 and "Traceback" not in step.stderr
    assert "ran compiled on 2 ranks, and collectives inside a compiled graph are not recorded" in step.stderr, step.stderr[-2000:]
