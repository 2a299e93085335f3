"""Found by the eighth newcomer trial (issue 15's session 18), each a test that failed before its
fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_newcomer_scripts import _env, _plain, _record, _replay, _script

pytestmark = pytest.mark.e2e


def _run(*cmd: Any, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(list(map(str, cmd)), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


# The loop catches a step's exception and logs its traceback, as serving loops do.
_LOGS_ITS_TRACEBACK = """
    import traceback
    import torch
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
        def forward(self, x, i):
            if i == 3:
                raise ValueError("request 3 has no KV blocks left")
            return self.lin(x)
    model = Decoder()
    with torch.no_grad():
        for i in range(5):
            try:
                model(torch.ones(2, 4), i)
            except ValueError as e:
                print("frames", [(f.filename.rsplit("/", 1)[-1], f.name) for f in traceback.extract_tb(e.__traceback__)])
"""


def test_a_step_s_exception_keeps_the_program_s_traceback_with_one_recorder_frame(tmp_path: Path) -> None:
    """A step that raises under the recorder: the program's traceback holds its own frames as in
    the plain run and one frame of the recorder's (before: four, from session.py)."""
    _script(tmp_path, "logs", _LOGS_ITS_TRACEBACK)
    plain = _plain(tmp_path, "logs")
    assert plain.returncode == 0, plain.stderr
    out, p = _record(tmp_path, "logs")
    frames = [eval(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith("frames")]  # noqa: S307
    plain_frames = [eval(ln.split(" ", 1)[1]) for ln in plain.stdout.splitlines() if ln.startswith("frames")]  # noqa: S307
    assert len(frames) == len(plain_frames) == 1, p.stdout
    ours = [f for f in frames[0] if f[0] == "session.py"]
    assert ours == [("session.py", "step_wrapper")], frames[0]
    # The program's own frames, in order (torch's own call path may hold one more frame while
    # the recorder's module hooks are installed).
    program = [f for f in frames[0] if f[0] == "logs.py"]
    assert program == [f for f in plain_frames[0] if f[0] == "logs.py"] == [("logs.py", "<module>"), ("logs.py", "forward")]
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert sum(r["raised_steps"] for r in info["ranks"]) == 1, info["ranks"]


_EAGER_MODULE = """
    import torch
    torch.manual_seed(3)
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32)
        def forward(self, ids):
            return self.out(torch.tanh(self.emb(ids)))
    model = Decoder().eval()
    ids = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids).argmax(-1)
    print(ids.tolist())
"""


def test_compiled_mode_of_an_eager_module_step_compiles_it_for_real(tmp_path: Path) -> None:
    """``--mode compiled`` of a module's forward recorded eager: the step is compiled by
    torch.compile and says so (before: the Python forward ran and the verdict read "re-ran bit
    for bit in compiled", with nothing compiled)."""
    _script(tmp_path, "eager", _EAGER_MODULE)
    out, _ = _record(tmp_path, "eager")
    p = _replay("step", out, "--step", 2, "--mode", "compiled", "--json", cwd=tmp_path)
    assert p.returncode in (0, 7), p.stderr[-2000:]
    run = json.loads(p.stdout)["modes"]["compiled"]
    assert run["ran_as"].startswith("torch.compile("), run
    assert "recorded uncompiled" in run["ran_as"]


_DEBUG_ONLY_CLAMP = """
    import torch
    torch.manual_seed(0)
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(30, 16)
            self.head = torch.nn.Linear(16, 30)
        def forward(self, tok):
            logits = self.head(torch.tanh(self.emb(tok)))
            if __debug__:  # left out under python -O
                logits = logits.clamp(-0.1, 0.1)
            return logits
    lm = LM().eval()
    tok = torch.tensor([1])
    with torch.no_grad():
        for _ in range(6):
            tok = lm(tok).argmax(-1)
"""


def test_a_program_run_with_interpreter_options_is_re_launched_with_them(tmp_path: Path) -> None:
    """``python3 -O script.py``: the re-launch passes -O again, and the step reproduces (before:
    re-launched as ``python3 script.py``, its debug-only code ran, "not reproduced")."""
    _script(tmp_path, "opt", _DEBUG_ONLY_CLAMP)
    out = tmp_path / "rec-opt"
    p = _run(sys.executable, "-m", "replay", "record", "--quiet", "--out", out, "--", sys.executable, "-O", "opt.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    p = _replay("step", out, "--step", 3, cwd=tmp_path)
    assert f"{sys.executable} -O opt.py" in p.stderr, p.stderr
    assert p.returncode == 0 and p.stdout.startswith("reproduced:"), p.stdout + p.stderr


_READS_ITS_ARGV = """
    import sys
    import torch
    print("THE SCRIPT'S LOOP RAN", file=sys.stderr)
    seed = int(sys.argv[1])
    torch.manual_seed(seed)
    class MoELM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.out = torch.nn.Linear(8, 16)
        def forward(self, ids):
            return self.out(self.emb(ids))
    model = MoELM().eval()
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        for _ in range(4):
            ids = model(ids).argmax(-1)
"""


def test_bisect_layers_across_runs_with_no_factory_never_runs_the_script(tmp_path: Path) -> None:
    """Two runs of a script whose model class is defined in it, no factory: ``bisect layers
    --between run:A,run:B`` says it needs a factory (before: it imported the script, which ran its
    loop in replay's process and failed on replay's own argv)."""
    _script(tmp_path, "moe", _READS_ITS_ARGV)
    for seed in (0, 1):
        p = _run(sys.executable, "-m", "replay", "record", "--quiet", "--out", tmp_path / f"rec{seed}", "--",
                 sys.executable, "moe.py", seed, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
    p = _replay("bisect", "layers", "--between", f"run:{tmp_path / 'rec0'},run:{tmp_path / 'rec1'}", "--step", 1, cwd=tmp_path)
    assert p.returncode != 0
    assert "THE SCRIPT'S LOOP RAN" not in p.stderr + p.stdout
    assert "names no factory" in p.stderr and "--factory" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


_OUT_BUFFER_UNDER_INFERENCE_MODE = """
    import torch
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 24)
            self.head = torch.nn.Linear(24, 40)
        def forward(self, tok, out):
            torch.matmul(torch.tanh(self.emb(tok)), self.head.weight.T, out=out)
    @torch.inference_mode()
    def main():
        torch.manual_seed(0)
        lm = LM().eval()
        logits = torch.empty(1, 40)
        tok = torch.tensor([1])
        for _ in range(6):
            lm(tok, logits)
            tok = logits.argmax(-1)
    main()
"""


def test_a_step_whose_results_cannot_be_seen_is_said_at_record_and_by_info(tmp_path: Path) -> None:
    """A step writing into an ``out=`` buffer made under inference mode (whose writes cannot be
    told): the recorder says nothing it computes is recorded, and ``info`` says a re-run has
    nothing to compare instead of offering one (before: silence, then "next: replay step")."""
    _script(tmp_path, "outbuf", _OUT_BUFFER_UNDER_INFERENCE_MODE)
    out = tmp_path / "rec-outbuf"
    p = _run(sys.executable, "-m", "replay", "record", "--out", out, "--", sys.executable, "outbuf.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "returns None and wrote into no tensor argument" in p.stderr and "inference tensors" in p.stderr, p.stderr
    info = _replay("info", out, cwd=tmp_path)
    assert "nothing to compare a re-run with" in info.stdout and "next: replay step" not in info.stdout, info.stdout


_DRAFT_SUBCLASSES_TARGET = """
    import torch
    torch.manual_seed(0)
    class TinyGPT(torch.nn.Module):
        def __init__(self, width=16):
            super().__init__()
            self.emb = torch.nn.Embedding(32, width)
            self.out = torch.nn.Linear(width, 32)
        def forward(self, ids):
            return self.out(torch.tanh(self.emb(ids)))
    class DraftGPT(TinyGPT):
        pass
    target, draft = TinyGPT().eval(), DraftGPT(8).eval()
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        for _ in range(4):
            ids = draft(ids).argmax(-1)
            ids = target(ids).argmax(-1)
"""


def test_a_draft_class_that_subclasses_the_target_is_recorded_when_both_are_named(tmp_path: Path) -> None:
    """``--step m:DraftGPT --step m:TinyGPT`` with ``class DraftGPT(TinyGPT)`` (the command the
    record summary suggests): both are steps, each its own stream (before: "--step m:DraftGPT
    never ran ... check the module and qualname", its calls recorded under TinyGPT)."""
    _script(tmp_path, "spec", _DRAFT_SUBCLASSES_TARGET)
    out, p = _record(tmp_path, "spec", "--step", "spec:DraftGPT", "--step", "spec:TinyGPT")
    assert "never ran" not in p.stderr, p.stderr
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert sorted(c["step"] for c in info["step_callables"]) == ["spec:DraftGPT", "spec:TinyGPT"], info["step_callables"]


# vLLM-style: the runner sets a global forward context the model reads; the model's inputs are
# only the token ids.
_GLOBAL_FORWARD_CONTEXT = """
    import torch
    torch.manual_seed(0)
    FORWARD_CONTEXT = {}
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32)
        def forward(self, ids):
            return self.out(self.emb(ids) * FORWARD_CONTEXT["scale"])
    class Runner:
        def __init__(self):
            self.model = Model().eval()
        def execute_model(self, ids, step):
            FORWARD_CONTEXT["scale"] = torch.full((1,), 1.0 + step)
            return self.model(ids)
    runner = Runner()
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        for step in range(6):
            ids = runner.execute_model(ids, step).argmax(-1)
"""


def test_a_step_that_reads_its_caller_s_global_context_names_the_caller_to_record(tmp_path: Path) -> None:
    """The model reads a global forward context its runner sets: from its own keyframe it is
    not reproduced, and the verdict names the runner's method to record instead, which then
    reproduces (before: a bare "not reproduced", and a --keyframe-every 1 hint that did not help)."""
    _script(tmp_path, "ctx", _GLOBAL_FORWARD_CONTEXT)
    out, _ = _record(tmp_path, "ctx", "--keyframe-every", "1")
    p = _replay("step", out, "--step", 2, cwd=tmp_path)
    head = p.stdout.splitlines()[0]
    assert head.startswith("not reproduced") and "replay record --step ctx:Runner.execute_model" in head, p.stdout + p.stderr
    rec = tmp_path / "rec-runner"
    r = _run(sys.executable, "-m", "replay", "record", "--quiet", "--out", rec, "--step", "ctx:Runner.execute_model", "--",
             sys.executable, "ctx.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    p = _replay("step", rec, "--step", 2, cwd=tmp_path)
    assert p.stdout.startswith("reproduced:"), p.stdout + p.stderr


_TEMPERATURE_HOOK = """
    import torch
    torch.manual_seed(0)
    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32)
        def forward(self, ids):
            return self.out(self.emb(ids))
    def temperature(module, args, logits):
        return logits / 0.7
    model = TinyLM().eval()
    model.register_forward_hook(temperature)
    ids = torch.tensor([1])
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids).argmax(-1)
"""


def test_the_record_summary_says_what_a_found_step_leaves_out(tmp_path: Path) -> None:
    """A module step found with no flags: the summary says its first call ran unrecorded (step 0
    is the program's second call), and that the program's forward hooks, which change what the
    program gets after forward, are outside what is recorded (before: neither was said)."""
    _script(tmp_path, "hooked", _TEMPERATURE_HOOK)
    out = tmp_path / "rec-hooked"
    p = _run(sys.executable, "-m", "replay", "record", "--out", out, "--", sys.executable, "hooked.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "4 calls recorded, from its second call: the first, which revealed it, ran unrecorded" in p.stderr, p.stderr
    assert "hooked:TinyLM has forward hooks of the program's (temperature)" in p.stderr, p.stderr


_READS_A_VARIABLE = """
    import os
    import torch
    torch.manual_seed(0)
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32)
        def forward(self, ids):
            logits = self.out(self.emb(ids))
            if os.environ.get("BAN"):
                logits[..., int(os.environ["BAN"])] = -1e9
            return logits
    model = LM().eval()
    ids = torch.tensor([1])
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids).argmax(-1)
"""


def test_diff_names_an_environment_variable_one_run_was_started_with(tmp_path: Path) -> None:
    """Two runs of one script, one started with BAN=3: ``diff`` names the variable under
    environment (before: "environment the same", though the recordings keep the variables'
    digests)."""
    _script(tmp_path, "ban", _READS_A_VARIABLE)
    for name, extra in (("a", {}), ("b", {"BAN": "3"})):
        env = {**_env(), **extra}
        env.pop("BAN", None) if not extra else None
        p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(tmp_path / name), "--",
                            sys.executable, "ban.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    d = _replay("diff", tmp_path / "a", tmp_path / "b", "--json", cwd=tmp_path)
    text = d.stdout
    assert "env.BAN" in text, text[-3000:]
    plain = _replay("diff", tmp_path / "a", tmp_path / "b", cwd=tmp_path).stdout
    assert "env.BAN: A not set, B set" in plain, plain


_LEAVES_THROUGH_OS_EXIT = """
    import os
    import torch
    model = torch.nn.Linear(4, 4)
    x = torch.ones(1, 4)
    with torch.no_grad():
        for _ in range(5):
            x = torch.tanh(model(x))
    os._exit(5)
"""


def test_info_says_why_a_rank_is_not_complete(tmp_path: Path) -> None:
    """A program that leaves through ``os._exit``: ``info`` says the rank ended without its end
    marker and which steps are kept (before: "complete no", with no reason; only verify said)."""
    _script(tmp_path, "exits", _LEAVES_THROUGH_OS_EXIT)
    out = tmp_path / "rec-exits"
    p = _run(sys.executable, "-m", "replay", "record", "--quiet", "--out", out, "--", sys.executable, "exits.py", cwd=tmp_path)
    assert p.returncode == 5, p.stderr[-2000:]
    info = _replay("info", out, cwd=tmp_path)
    assert "rank 0: ended without its end marker (killed, crashed, or os._exit): steps 0..3 are kept" in info.stdout, info.stdout


@pytest.mark.parametrize("cmd, name", [
    (["python3", "-m", "mypkg.serve", "--steps", "12", "--seed", "3"], "mypkg.serve"),
    (["python3", "-W", "error", "dict_step.py"], "dict_step"),
    (["torchrun", "--nproc-per-node", "2", "train.py", "--x", "1"], "torchrun-train"),
    (["env", "A=1", "python3", "x.py"], "x"),
])
def test_a_recording_is_named_after_its_program_not_an_option_s_value(cmd: list[str], name: str) -> None:
    """(before: ``mypkg.serve-12`` and ``error-dict_step``)"""
    from replay.record.wrapper import _slug

    assert _slug(cmd) == name


_RETURNS_IDS_AND_LOGITS = """
    import torch
    torch.manual_seed(0)
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.out = torch.nn.Linear(16, 32)
        def forward(self, ids):
            logits = self.out(self.emb(ids))
            return logits.argmax(-1), logits
    model = LM().eval()
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        for _ in range(5):
            ids, _ = model(ids)
"""


def test_ids_a_step_returns_by_place_are_its_tokens(tmp_path: Path) -> None:
    """``return next_ids, logits``: the unnamed integer output is a token field (compared first,
    kept whole), and the step re-runs with both compared (before: "out0" was an output, and
    ``diff`` said "no token field recorded to compare")."""
    _script(tmp_path, "tup", _RETURNS_IDS_AND_LOGITS)
    out, _ = _record(tmp_path, "tup")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert info["token_fields"] is True, info
    p = _replay("step", out, "--step", 2, cwd=tmp_path)
    assert p.stdout.startswith("reproduced:") and "2 output(s) bitwise equal" in p.stdout, p.stdout + p.stderr


def test_bisect_on_one_rank_takes_that_rank(tmp_path: Path) -> None:
    """One rank, no factory: ``bisect config --step 1`` and ``bisect layers --between
    eager,cudagraph --step 1`` say what they need (a factory), not "give --rank R" for the only
    rank there is (before: 'the ranks never disagree: give --rank R and --step S')."""
    _script(tmp_path, "eager", _EAGER_MODULE)
    out, _ = _record(tmp_path, "eager")
    for args in (("config", out, "--step", 1), ("layers", out, "--step", 1, "--between", "eager,cudagraph")):
        p = _replay("bisect", *args, cwd=tmp_path)
        assert p.returncode != 0 and "needs a factory" in p.stderr and "give --rank" not in p.stderr, p.stderr
