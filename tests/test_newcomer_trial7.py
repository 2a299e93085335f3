"""Bugs found by the seventh newcomer trial (issue 15's session 17), each a test that failed
before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_newcomer_scripts import _env, _record, _replay, _script

pytestmark = pytest.mark.e2e


def _run(*cmd: Any, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A command with the tests' environment and ``env`` on top (a program that reads a variable)."""
    return subprocess.run(list(map(str, cmd)), cwd=cwd, env={**_env(), **env}, capture_output=True, text=True, timeout=300)


def _record_with(tmp: Path, out: Path, script: str, *flags: Any, args: tuple[str, ...] = (), **env: str) -> Path:
    """``replay record --quiet [flags] --out OUT -- python SCRIPT [args]`` with ``env`` set."""
    p = _run(sys.executable, "-m", "replay", "record", "--quiet", *flags, "--out", out, "--", sys.executable, script, *args,
             cwd=tmp, **env)
    assert p.returncode == 0 and os.path.isdir(out), p.stderr[-2000:]
    return out

# The loop changes the model's state between steps, outside the step: only a keyframe at each
# step holds that; catch-up from an earlier keyframe cannot.
_HALVE = """
    import torch
    torch.manual_seed(0)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)
            self.register_buffer("memory", torch.ones(8))
        def forward(self, x):
            return self.lin(x * self.memory)
    model = Decoder().eval()
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(6):
            logits = model(x)
            x = logits[:, :8].tanh()
            model.memory.mul_(0.5)
"""


@pytest.mark.smoke
def test_bisect_against_rerun_restores_each_keyframe_it_reaches_as_replay_step_does(tmp_path: Path) -> None:
    """Recorded with ``--keyframe-every 1``: ``replay step`` reproduces every step from its own
    keyframe, so ``bisect steps --against-rerun`` finds no departure (before: its one launch
    caught up from step 0 and said "first departs at step 1", a step ``replay step`` reproduced)."""
    _script(tmp_path, "halve", _HALVE)
    rec, _ = _record(tmp_path, "halve", "--keyframe-every", "1")
    one = _replay("step", rec, "--step", 2, "--no-save", cwd=tmp_path)
    assert one.returncode == 0 and one.stdout.startswith("reproduced"), one.stdout + one.stderr[-2000:]
    b = _replay("bisect", "steps", "--against-rerun", rec, "--no-save", "--json", cwd=tmp_path)
    assert b.returncode == 0, b.stdout + b.stderr[-2000:]
    found = json.loads(b.stdout)
    assert found["first"] is None, found
    assert any(n.startswith("restored the keyframes at steps 1, 2, 3") for n in found["notes"]), found["notes"]


# One step of the loop runs with a buffer the loop sets around it and puts back: the re-run's
# catch-up (which drives the step alone) departs there, and the steps after it match again.
_ONCE = """
    import torch
    torch.manual_seed(0)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 16)
            self.register_buffer("memory", torch.ones(8))
        def forward(self, x):
            return self.lin(x * self.memory)
    model = Decoder().eval()
    with torch.no_grad():
        for i in range(6):
            if i == 2:
                model.memory.fill_(0.5)
            logits = model(torch.randn(1, 8))
            if i == 2:
                model.memory.fill_(1.0)
"""


@pytest.mark.smoke
def test_a_step_that_matches_after_a_catch_up_departure_says_so_in_its_verdict_line(tmp_path: Path) -> None:
    """``replay step 3`` catches up over steps 0..2 and step 1 departs; step 3 itself matches.
    The verdict line says both (before: a bare "reproduced ... bit for bit", the departure only
    further down)."""
    _script(tmp_path, "once", _ONCE)
    rec, _ = _record(tmp_path, "once")
    one = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    head = one.stdout.splitlines()[0]
    assert head.startswith("reproduced"), one.stdout + one.stderr[-2000:]
    assert "but catch-up step 1 (output.logits) departed from the recording in eager" in head, head


# A draft and a target model in one loop, recorded as two streams; the environment changes the
# target's weights (SCALE), compiles it (COMPILE) or skips one draft call (SKIP).
_SPEC = """
    import os, torch
    torch.manual_seed(0)
    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.lin = torch.nn.Linear(8, 16)
        def forward(self, x):
            return self.lin(x)
    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.lin = torch.nn.Linear(8, 16); self.out = torch.nn.Linear(16, 16)
        def forward(self, x):
            return self.out(self.lin(x).relu())
    draft, target = Draft().eval(), Target().eval()
    if os.environ.get("SCALE"):
        with torch.no_grad():
            target.out.weight.mul_(float(os.environ["SCALE"]))
    if os.environ.get("COMPILE"):
        target = torch.compile(target, backend=os.environ["COMPILE"])
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(6):
            d = draft(x) if not (os.environ.get("SKIP") and i == 3) else torch.zeros(1, 16)
            t = target(x)
            x = (d + t)[:, :8].tanh()
"""


def _record_spec(tmp: Path, name: str, **env: str) -> Path:
    return _record_with(tmp, tmp / name, "spec.py", "--step", "spec:Draft", "--step", "spec:Target", **env)


def test_diff_compares_each_model_of_a_loop_and_names_its_stream(tmp_path: Path) -> None:
    """``replay diff`` of a draft-and-target loop: the target's changed weights are named with
    its stream (before: "weights the same", only the first model's compared), the first
    difference says which model's step it is, a compile backend given to the target only is
    named (before: "config the same"), and a run that called its models in another order says
    from which step the steps it pairs are of different models."""
    _script(tmp_path, "spec", _SPEC)
    a = _record_spec(tmp_path, "a")
    scaled = _record_spec(tmp_path, "scaled", SCALE="1.001")
    compiled = _record_spec(tmp_path, "compiled", COMPILE="aot_eager")
    skipped = _record_spec(tmp_path, "skipped", SKIP="1")

    d = _replay("diff", a, scaled, "--json", cwd=tmp_path)
    assert d.returncode == 1, d.stdout + d.stderr[-2000:]
    r = json.loads(d.stdout)
    weights = next(c for c in r["other_differences"] if c["category"] == "weights")
    assert [i["name"] for i in weights["items"]] == ["out.weight (stream target)"], weights
    first = r["first_difference"]
    assert (first["step"], first["model_stream"], first["model_stream_step"]) == (1, "target", 0), first
    assert "step 1 (stream target, its step 0)" in r["headline"], r["headline"]

    c = json.loads(_replay("diff", a, compiled, "--json", cwd=tmp_path).stdout)
    config = next(x for x in c["other_differences"] if x["category"] == "config")
    assert [i["name"] for i in config["items"]] == ["target.compile (stream target)"], config
    assert "aot_eager" in str(config["items"][0]["b"]), config

    s = json.loads(_replay("diff", a, skipped, "--json", cwd=tmp_path).stdout)
    assert any("from step 6 the runs ran their models in another order (A draft, B target)" in n for n in s["notes"]), s["notes"]


# The program picks its torch.compile backend from the environment; it sets a variable of its own.
_COMPILED_BY_ENV = """
    import os, torch
    os.environ["MY_ENGINE_MODE"] = "fast"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).eval()
    step = torch.compile(model, backend=os.environ.get("BACKEND", "eager"))
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(5):
            y = step(x)
            x = y[:, :8].tanh()
"""


def test_a_compiled_step_is_compiled_again_as_recorded_and_led_by_its_recorded_mode(tmp_path: Path) -> None:
    """Recorded with BACKEND=aot_eager, re-run where BACKEND is not set: the compiled mode runs
    the recorded backend (before: the re-launched program's own, 'eager'), says so, comes first
    in the verdict, and a variable the program set itself is not called a difference of the
    environment (before: 'MY_ENGINE_MODE (not set here)')."""
    _script(tmp_path, "comp", _COMPILED_BY_ENV)
    rec = _record_with(tmp_path, tmp_path / "rec", "comp.py", BACKEND="aot_eager")
    s = _replay("step", rec, "--step", 2, "--no-save", "--json", cwd=tmp_path)
    assert s.returncode == 0, s.stdout + s.stderr[-2000:]
    r = json.loads(s.stdout)
    assert list(r["modes"]) == ["compiled", "eager"], list(r["modes"])
    assert "backend='aot_eager'" in r["modes"]["compiled"]["ran_as"], r["modes"]["compiled"]
    assert any("called torch.compile with backend='eager'; compiled again as recorded" in n for n in r["notes"]), r["notes"]
    assert r["env_differences"] == ["BACKEND (not set here)"], r["env_differences"]


# The loop grows the model's cache buffer between steps (a new, longer tensor each step).
_GROW = """
    import torch
    torch.manual_seed(0)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("cache", torch.zeros(1, 8))
        def forward(self, x, pos):
            return self.lin(x + self.cache[pos])
    model = Decoder().eval()
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(8):
            y = model(x, i)
            model.cache = torch.cat([model.cache, y])
            x = y.tanh()
"""


def test_a_cache_the_loop_grows_is_restored_from_a_keyframe_and_a_catch_up_says_what_to_record(tmp_path: Path) -> None:
    """(And the report of a step that raised says so.) A keyframe of a buffer the loop grows is set in place of the program's shorter one (before:
    "was the target built from another config?", with no factory); a step that then raises
    after catch-up, and a catch-up step that raises, name ``--keyframe-every 1``; with it, every
    step reproduces."""
    _script(tmp_path, "grow", _GROW)
    none, _ = _record(tmp_path, "grow")
    caught = _replay("step", none, "--step", 4, "--no-save", cwd=tmp_path)
    assert caught.returncode == 7, caught.stdout + caught.stderr[-2000:]
    assert "catch-up step 1 raised IndexError" in caught.stderr and "--keyframe-every 1" in caught.stderr, caught.stderr[-2000:]

    every3 = _record_with(tmp_path, tmp_path / "every3", "grow.py", "--keyframe-every", 3)
    raised = _replay("step", every3, "--step", 4, cwd=tmp_path)  # saved: the report shows it below
    assert raised.returncode == 7, raised.stdout + raised.stderr[-2000:]
    assert raised.stdout.startswith("not compared: rank 0 step 4: eager: step 4 raised IndexError"), raised.stdout
    assert "another config" not in raised.stdout + raised.stderr and "--keyframe-every 1" in raised.stdout, raised.stdout
    # The report shows the saved result's verdict and why nothing was compared (before: "No
    # verdicts recorded.", as if the step had not been re-run).
    page = tmp_path / "report.html"
    assert _replay("report", every3, "-o", page, cwd=tmp_path).returncode == 0
    html = page.read_text()
    assert "Nothing was compared: eager: step 4 raised IndexError" in html and "No verdicts recorded" not in html
    assert "<b>not compared: rank 0 step 4" in html

    every1 = _record_with(tmp_path, tmp_path / "every1", "grow.py", "--keyframe-every", 1)
    ok = _replay("step", every1, "--step", 5, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr[-2000:]


# An engine whose step is ``async def``, driven by asyncio (as a serving loop is).
_ASYNC = """
    import asyncio, sys, torch
    torch.manual_seed(0)
    class Engine:
        def __init__(self):
            self.model = torch.nn.Linear(8, 8).eval()
        async def step(self, x):
            await asyncio.sleep(float(sys.argv[1]))
            with torch.no_grad():
                return self.model(x)
    async def main():
        eng = Engine()
        x = torch.randn(1, 8)
        for i in range(5):
            y = await eng.step(x)
            x = y.tanh()
        print("sum", float(x.sum()))
    asyncio.run(main())
"""


def test_an_async_step_is_recorded_when_awaited_and_re_run(tmp_path: Path) -> None:
    """``--step mod:Engine.step`` naming an ``async def``: its outputs are recorded when the
    program awaits it (before: a coroutine, no output recorded, and info still offered
    ``replay step``), a re-run runs the coroutine and reproduces the step; one that waits on a
    real future inside the program's loop is refused in one line, never called reproduced."""
    _script(tmp_path, "asy", _ASYNC)
    plain = _run(sys.executable, "asy.py", "0", cwd=tmp_path)
    recs = {}
    for name, delay in (("bare", "0"), ("io", "0.001")):
        recs[name] = tmp_path / name
        p = _replay("record", "--quiet", "--step", "asy:Engine.step", "--out", recs[name], "--", sys.executable, "asy.py", delay,
                    cwd=tmp_path)
        assert p.returncode == 0 and p.stdout == plain.stdout, p.stdout + p.stderr[-2000:]
    info = json.loads(_replay("info", recs["bare"], "--json", cwd=tmp_path).stdout)
    assert info["output_fields"] and info["ranks"][0]["steps"] == 5, info
    ok = _replay("step", recs["bare"], "--step", 2, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr[-2000:]
    io = _replay("step", recs["io"], "--step", 2, "--no-save", cwd=tmp_path)
    assert io.returncode != 0 and "Traceback" not in io.stderr, io.stdout + io.stderr[-2000:]
    assert "the async step waits on Future" in io.stderr and "reproduced" not in io.stdout, io.stdout + io.stderr[-2000:]


# A loop over a torch.jit.script'ed model, and the same model called through a Python function.
_SCRIPTED = """
    import sys, torch
    torch.manual_seed(0)
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.lin = torch.nn.Linear(8, 8)
        def forward(self, x):
            return self.lin(x).relu()
    def decode(m, x):
        return m(x)
    m = torch.jit.script(M().eval())
    x = torch.randn(1, 8)
    with torch.no_grad():
        for i in range(6):
            x = decode(m, x) if sys.argv[1:] == ["function"] else m(x)
"""


def test_a_torchscript_model_is_named_as_such_and_the_function_that_calls_it_is_recorded(tmp_path: Path) -> None:
    """No flags, or ``--step`` naming the ScriptModule class: one line says it is TorchScript and
    what to name instead (before: "name the step with --step MODULE:QUALNAME", then an internal
    "'_CachedForward' object has no attribute" for the name it suggested); the Python function
    that calls it is recorded and reproduces."""
    _script(tmp_path, "scripted", _SCRIPTED)
    for flags in ([], ["--step", "torch.jit._script:RecursiveScriptModule"]):
        out = tmp_path / f"rec{len(flags)}"
        p = _replay("record", "--out", out, *flags, "--", sys.executable, "scripted.py", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "TorchScript (torch.jit.script or trace), whose forward runs no Python" in p.stderr, p.stderr[-2000:]
        assert "--step MODULE:FUNCTION" in p.stderr and "_CachedForward" not in p.stderr, p.stderr[-2000:]
    rec = _record_with(tmp_path, tmp_path / "fn", "scripted.py", "--step", "scripted:decode", args=("function",))
    ok = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr[-2000:]
    # info names what was recorded as the step (before: nowhere, though the docs said so).
    info = _replay("info", rec, cwd=tmp_path).stdout
    assert "step        scripted:decode (a function)" in info, info
    data = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert data["step_callables"] == [{"stream": None, "step": "scripted:decode", "kind": "function"}], data


# A serving loop whose step is an engine method with no arguments: it builds its batch from its
# own requests (a dict the loop changes between steps) and runs its one model.
_SERVE = """
    import dataclasses, torch
    torch.manual_seed(0)
    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor
        positions: torch.Tensor
        slots: torch.Tensor
    class TinyLM(torch.nn.Module):
        def __init__(self, vocab=64, dim=32):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, dim)
            self.kv = torch.nn.Linear(dim, dim)
            self.out = torch.nn.Linear(dim, vocab)
            self.register_buffer("k_cache", torch.zeros(8, 32, dim))
        def forward(self, batch):
            h = self.emb(batch.tokens)
            self.k_cache[batch.slots, batch.positions] = self.kv(h)
            return self.out(h + self.k_cache[batch.slots].sum(1))
    class Engine:
        def __init__(self):
            self.model = TinyLM().eval()
            self.requests = {}
        @torch.no_grad()
        def step(self):
            slots = sorted(self.requests)
            batch = Batch(torch.tensor([self.requests[s][-1] for s in slots]),
                          torch.tensor([len(self.requests[s]) - 1 for s in slots]), torch.tensor(slots))
            nxt = self.model(batch).argmax(-1)
            for s, t in zip(slots, nxt.tolist()):
                self.requests[s].append(t)
            return nxt
    eng = Engine()
    eng.requests = {0: [5], 3: [9]}
    for i in range(8):
        if i == 4:
            eng.requests[5] = [17]
        eng.step()
"""


def test_an_engine_method_s_model_is_digested_and_kept_and_its_python_state_named(tmp_path: Path) -> None:
    """``--step serve:Engine.step``: the one model the engine holds has its weights digested and
    its buffers in keyframes (before: "no state keyframe recorded: a fresh target", weights not
    recorded), and a step that does not reproduce because it builds its batch from the engine's
    Python state says so in its verdict line, instead of offering --keyframe-every 1 again."""
    _script(tmp_path, "serve", _SERVE)
    rec = _record_with(tmp_path, tmp_path / "rec", "serve.py", "--keyframe-every", 1, "--step", "serve:Engine.step")
    s = _replay("step", rec, "--step", 6, "--no-save", cwd=tmp_path)
    assert s.returncode == 0, s.stdout + s.stderr[-2000:]  # compared: a difference is a result (docs/rerun.md)
    head = s.stdout.splitlines()[0]
    assert head.startswith("not reproduced") and "computes from its Engine object's Python state" in head, s.stdout
    assert "from the keyframe at step 6" in s.stdout and "weights: all 5 parameters have the digests recorded" in s.stdout, s.stdout
    assert "--keyframe-every 1" not in s.stdout, s.stdout
