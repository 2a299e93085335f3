"""Found by the ninth newcomer trial (issue 15's session 19), each a test that failed before its
fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _env, _plain, _record, _replay, _script

pytestmark = pytest.mark.e2e


# An encoder-decoder decoded as ``generate()`` does it: the encoder called on its own once, then
# the whole model each step (which calls the decoder). The encoder and the decoder are one class
# with a flag (T5's ``T5Stack``), or two classes (BART's encoder and decoder).
_SEQ2SEQ = """
    import torch, torch.nn as nn
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self, cross):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.mix = nn.Linear(16, 16)
            self.cross = nn.Linear(16, 16) if cross else None
        def forward(self, ids, memory=None):
            h = torch.tanh(self.mix(self.emb(ids)))
            if self.cross is not None:
                h = h + self.cross(memory.mean(1, keepdim=True))
            return {"last_hidden_state": h}

    class Decoder(Stack):
        pass

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Stack(False)
            self.decoder = DECODER(True)
            self.head = nn.Linear(16, 50)
        def forward(self, ids, memory):
            return self.head(self.decoder(ids, memory)["last_hidden_state"])

    model = Seq2Seq().eval()
    src = torch.randint(0, 50, (2, 7))
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        memory = model.encoder(src)["last_hidden_state"]
        for _ in range(6):
            logits = model(ids[:, -1:], memory)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    print(ids.tolist())
"""


@pytest.mark.parametrize("decoder", ["Stack", "Decoder"])
def test_an_encoder_run_once_before_the_loop_is_not_the_step(tmp_path: Path, decoder: str) -> None:
    """The first outermost module call was the encoder's, run once before the loop: the step is
    the model that holds it, called each step (before: the encoder's class was the step; with a
    decoder of its class, the decoder's calls were recorded and the re-launch took the encoder's
    call as the step's, 'not reproduced' with other weights; with a class of its own, nothing
    was recorded)."""
    _script(tmp_path, "s2s", _SEQ2SEQ.replace("DECODER", decoder))
    plain = _plain(tmp_path, "s2s")
    out, p = _record(tmp_path, "s2s")
    assert p.stdout == plain.stdout
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [c["step"] for c in info["step_callables"]] == ["s2s:Seq2Seq"], info["step_callables"]
    assert info["ranks"][0]["steps"] == 5  # the first call revealed it
    summary = _replay("record", "--out", tmp_path / "again", "--", "python3", "s2s.py", cwd=tmp_path).stderr
    assert "which holds s2s:Stack" in summary, summary
    for step in (0, 4):
        r = _replay("step", out, "--rank", "0", "--step", step, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


# An HF-style output object: a dict of its own class, read by place (``encoder_outputs[0]``).
_MODEL_OUTPUT_ARG = """
    import collections
    import torch, torch.nn as nn
    torch.manual_seed(0)

    class Output(collections.OrderedDict):
        def __getitem__(self, k):
            return list(self.values())[k] if isinstance(k, int) else super().__getitem__(k)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.out = nn.Linear(16, 50)
        def forward(self, ids, encoder_outputs):
            return self.out(self.emb(ids) + encoder_outputs[0].mean(1, keepdim=True))

    model = Decoder().eval()
    enc = Output(last_hidden_state=torch.randn(2, 5, 16))
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids, enc).argmax(-1)
    print(ids.tolist())
"""


def test_a_dict_of_its_own_class_is_given_back_as_that_class(tmp_path: Path) -> None:
    """A step argument that is a dict subclass read by place (an HF ``ModelOutput``'s
    ``encoder_outputs[0]``): the re-run gives the step the program's class with the recorded
    items (before: a plain dict, and the step raised KeyError: 0 in the re-run)."""
    _script(tmp_path, "mo", _MODEL_OUTPUT_ARG)
    out, _ = _record(tmp_path, "mo")
    r = _replay("step", out, "--rank", "0", "--step", "2", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_a_re_launch_takes_the_call_of_the_recorded_model_not_another_instance(tmp_path: Path) -> None:
    """An encoder and a decoder of one class, each called at the top level: the encoder's one
    call revealed the step, the decoder's calls are what was recorded. The re-launched program
    calls the encoder first: that call runs as the program runs it, and the decoder's is taken
    (before: the encoder's call was taken as the step's, and the verdict was 'not reproduced'
    with other weights)."""
    _script(tmp_path, "pair", _SEQ2SEQ.replace("DECODER", "Stack").replace(
        "memory = model.encoder(src)", "memory = model.encoder(src)").replace(
        "logits = model(ids[:, -1:], memory)", "logits = model.head(model.decoder(ids[:, -1:], memory)['last_hidden_state'])"))
    out, _ = _record(tmp_path, "pair")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [c["step"] for c in info["step_callables"]] == ["pair:Stack"], info["step_callables"]
    assert info["ranks"][0]["steps"] == 6  # the decoder's calls, every one
    r = _replay("step", out, "--rank", "0", "--step", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


# A small recurrent model whose forward names its first parameter ``s``, not ``self``.
_TINY_LM = """
    import torch, torch.nn as nn
    class LM(nn.Module):
        def __init__(s, V=30, D=8):
            super().__init__(); torch.manual_seed(0)
            s.emb = nn.Embedding(V, D); s.rnn = nn.GRUCell(D, D); s.out = nn.Linear(D, V)
            s.register_buffer("h", torch.zeros(1, D))
        def forward(s, ids):
            s.h.copy_(s.rnn(s.emb(ids), s.h)); return s.out(s.h)
"""

# Two workers forked by multiprocessing decode; the parent waits for their results on a queue.
_FORKED_WORKERS = """
    import multiprocessing as mp, torch
    from tiny_lm import LM
    m = LM().eval()
    def work(prompt, q):
        ids = torch.tensor([prompt]); t = []
        with torch.no_grad():
            for _ in range(6):
                ids = m(ids).argmax(-1); t.append(int(ids))
        q.put((prompt, t))
    if __name__ == "__main__":
        ctx = mp.get_context("fork"); q = ctx.Queue()
        ps = [ctx.Process(target=work, args=(p, q)) for p in (4, 9)]
        for p in ps: p.start()
        res = sorted(q.get() for _ in ps)
        for p in ps: p.join()
        print(res, [p.exitcode for p in ps])
"""


def test_a_step_of_a_forked_worker_is_re_run_and_the_program_stopped(tmp_path: Path) -> None:
    """Workers forked by multiprocessing, whose parent waits for them on a queue: each worker's
    recording is complete, the summary names the step, and `replay step` of a worker's part
    comes back (before: it waited forever for the re-launched parent, which waited for the
    worker the re-run had stopped; the summary said no step was found, and the parts had no
    end marker)."""
    _script(tmp_path, "tiny_lm", _TINY_LM)
    _script(tmp_path, "forked", _FORKED_WORKERS)
    out, p = _record(tmp_path, "forked")
    summary = _replay("record", "--out", tmp_path / "again", "--", "python3", "forked.py", cwd=tmp_path).stderr
    assert "step found with no flags: tiny_lm:LM" in summary, summary
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert len(info["parts"]) == 2 and all(r["complete"] for r in info["ranks"]), info
    v = _replay("verify", out, cwd=tmp_path)
    assert v.returncode == 0, v.stdout + v.stderr
    r = subprocess.run([sys.executable, "-m", "replay", "step", str(out), "--part", "run-001", "--step", "3"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_a_module_named_by_its_class_is_its_forward_whatever_its_first_parameter(tmp_path: Path) -> None:
    """`--step script:LM` for a module whose forward is ``def forward(s, ids)``: recorded as the
    module's forward, and re-run (before: taken for a function, and every re-run said the
    program ended without calling the step)."""
    _script(tmp_path, "tiny_lm", _TINY_LM)
    _script(tmp_path, "loop", """
        import torch
        from tiny_lm import LM
        m = LM().eval(); ids = torch.tensor([1])
        with torch.no_grad():
            for _ in range(6):
                ids = m(ids).argmax(-1)
        print(ids.tolist())
    """)
    out, _ = _record(tmp_path, "loop", "--step", "tiny_lm:LM")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert info["step_callables"][0]["kind"] == "module_forward", info["step_callables"]
    r = _replay("step", out, "--step", "4", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_a_parametrization_is_never_the_step(tmp_path: Path) -> None:
    """`torch.nn.utils.parametrize` computes a weight by calling its parametrization modules
    when the model reads it, an outermost module call before the model's own: the model is the
    step (before: `ParametrizationList`, whose output, the weight, was compared as logits)."""
    _script(tmp_path, "param", """
        import torch, torch.nn as nn
        import torch.nn.utils.parametrize as P
        torch.manual_seed(0)
        class Symmetric(nn.Module):
            def forward(self, w):
                return w.triu() + w.triu(1).T
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(20, 16); self.mix = nn.Linear(16, 16); self.out = nn.Linear(16, 20)
                P.register_parametrization(self.mix, "weight", Symmetric())
            def forward(self, ids):
                w = self.mix.weight
                return self.out(torch.tanh(self.emb(ids) @ w))
        m = LM().eval(); ids = torch.tensor([3])
        with torch.no_grad():
            _ = m.mix.weight
            for _ in range(6):
                ids = m(ids).argmax(-1)
        print(ids.tolist())
    """)
    out, _ = _record(tmp_path, "param")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [c["step"] for c in info["step_callables"]] == ["param:LM"], info["step_callables"]


def test_a_script_edited_since_the_recording_is_named_in_the_verdict(tmp_path: Path) -> None:
    """The script was edited after it was recorded (a constant changed): the 'not reproduced'
    line says its source changed (before: nothing said so, and the user chased a bug that was
    not there)."""
    path = _script(tmp_path, "edited", """
        import torch, torch.nn as nn
        SCALE = 1.0
        torch.manual_seed(0)
        class LM(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(20, 8); self.out = nn.Linear(8, 20)
            def forward(self, ids):
                return self.out(self.emb(ids) * SCALE)
        m = LM().eval(); ids = torch.tensor([3])
        with torch.no_grad():
            for _ in range(6):
                ids = m(ids).argmax(-1)
        print(ids.tolist())
    """)
    out, _ = _record(tmp_path, "edited")
    path.write_text(path.read_text().replace("SCALE = 1.0", "SCALE = 1.001"))
    r = _replay("step", out, "--step", "3", cwd=tmp_path)
    head = r.stdout.splitlines()[0] if r.stdout else ""
    assert head.startswith("not reproduced") and "source changed since it was recorded (edited.py (changed))" in head, \
        r.stdout + r.stderr


def test_python_dash_c_is_re_launched_with_its_code(tmp_path: Path) -> None:
    """`replay record -- python3 -c CODE`: `replay step` re-launches the code (before: 'its code
    is not recorded: pass --factory', while info's next: line offered that very command)."""
    _script(tmp_path, "tiny_lm", _TINY_LM)
    code = ("import torch\nfrom tiny_lm import LM\nm = LM().eval(); ids = torch.tensor([5])\n"
            "with torch.no_grad():\n    for _ in range(6):\n        ids = m(ids).argmax(-1)\nprint(ids.tolist())\n")
    out = tmp_path / "rec-c"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "-c", code, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = _replay("step", out, "--step", "4", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_a_functorch_transform_s_calls_are_not_steps(tmp_path: Path) -> None:
    """Modules called inside `torch.func.vmap` get tensors with no storage: never recorded (before:
    the recorder failed on them and stopped, and info called the rank 'killed, crashed, or
    os._exit'); the function named with --step, whose parameters are a dict by dotted names,
    is recorded and re-run."""
    _script(tmp_path, "vm", """
        import torch, torch.nn as nn
        from torch.func import functional_call, vmap
        torch.manual_seed(0)
        lin = nn.Linear(8, 8).eval()
        params = {k: v.detach() for k, v in lin.named_parameters()}
        params = {"lin." + k: v for k, v in params.items()}
        def one(params, x):
            return functional_call(lin, {k[4:]: v for k, v in params.items()}, (x,))
        def decode_step(params, x):
            return vmap(one, in_dims=(None, 0))(params, x)
        x = torch.randn(3, 8)
        with torch.no_grad():
            for _ in range(5):
                x = torch.tanh(decode_step(params, x))
        print(x.sum().item())
    """)
    p = _replay("record", "--out", tmp_path / "nf", "--", sys.executable, "vm.py", cwd=tmp_path)
    assert "recording stopped" not in p.stderr, p.stderr
    out, p = _record(tmp_path, "vm", "--step", "vm:decode_step")
    assert "recorded by class name only" not in p.stderr, p.stderr
    r = _replay("step", out, "--step", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_info_names_the_part_in_its_next_command_and_a_stopped_recorder(tmp_path: Path) -> None:
    """With several parts, info's next: line names the part it showed (before: `replay step`
    without --part re-ran another part's step); `REC:PART` says to give --part; a recorder that
    stopped itself is said so (before: 'killed, crashed, or os._exit')."""
    _script(tmp_path, "tiny_lm", _TINY_LM)
    _script(tmp_path, "forked", _FORKED_WORKERS)
    out, _ = _record(tmp_path, "forked")
    text = _replay("info", out, "--part", "run-001", cwd=tmp_path).stdout
    assert f"next: replay step {out} --part run-001 --rank 0 --step 4" in text, text
    bad = _replay("info", f"{out}:run-001", cwd=tmp_path)
    assert bad.returncode != 0 and "give --part run-001" in bad.stderr, bad.stderr
    _script(tmp_path, "slow", """
        import torch
        from tiny_lm import LM
        m = LM().eval(); ids = torch.tensor([1])
        with torch.no_grad():
            for _ in range(40):
                ids = m(ids).argmax(-1)
    """)
    stopped, _ = _record(tmp_path, "slow", "--max-bytes", "20000")
    text = _replay("info", stopped, cwd=tmp_path).stdout
    assert "the recorder stopped itself (" in text and "killed, crashed" not in text, text


def test_a_state_change_between_steps_is_hinted_at_the_first_step_it_shows(tmp_path: Path) -> None:
    """A beam search reorders the model's cache between steps, outside the step: step 1 re-runs
    from the keyframe at step 0 (which re-runs bit for bit) and differs; the verdict names the
    remedy, which then reproduces it (before: a bare 'not reproduced', the hint only at steps
    where a catch-up step departed)."""
    _script(tmp_path, "beam", """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(20, 8); self.out = nn.Linear(8, 20)
                self.register_buffer("cache", torch.zeros(3, 8))
            def forward(self, ids):
                self.cache.add_(self.emb(ids))
                return self.out(self.cache)
        m = LM().eval(); ids = torch.tensor([1, 2, 3])
        with torch.no_grad():
            for _ in range(5):
                logits = m(ids)
                ids = logits.argmax(-1)
                m.cache.copy_(m.cache.index_select(0, torch.tensor([2, 0, 1])))  # the beams' new order
        print(ids.tolist())
    """)
    out, _ = _record(tmp_path, "beam")
    r = _replay("step", out, "--step", "1", cwd=tmp_path)
    head = r.stdout.splitlines()[0] if r.stdout else ""
    assert head.startswith("not reproduced") and "replay record --keyframe-every 1" in head, r.stdout + r.stderr
    (tmp_path / "beam_kf.py").write_text((tmp_path / "beam.py").read_text())
    kf, _ = _record(tmp_path, "beam_kf", "--keyframe-every", "1")
    r = _replay("step", kf, "--step", "1", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


# A cache object with behaviour (recorded by class name only) that the step grows.
_GROWING_CACHE = """
    import sys
    import torch, torch.nn as nn
    torch.manual_seed(0)
    class Cache:
        def __init__(self):
            self.keys = []
        def update(self, k):
            self.keys.append(k)
            return torch.stack(self.keys).mean(0)
    class LM(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(20, 8); self.out = nn.Linear(8, 20)
        def forward(self, ids, cache):
            return self.out(cache.update(self.emb(ids)))
    m = LM().eval()
    if "compiled" in sys.argv:
        m.forward = torch.compile(m.forward, backend="eager")
    cache, ids = Cache(), torch.tensor([1, 2])
    with torch.no_grad():
        for _ in range(5):
            ids = m(ids, cache).argmax(-1)
    print(ids.tolist())
"""


def test_each_mode_and_each_repeat_starts_from_its_own_copy_of_a_held_object(tmp_path: Path) -> None:
    """A step that grows a cache object held by class name only: the re-run's second mode (after
    compiled, eager) and each --repeat start from a copy of it as the step was taken (before: from
    what the run before left in it, so a torch.compile(backend="eager") step was 'not reproduced
    in compiled' while each mode alone reproduced, and --repeat blamed a nondeterministic kernel)."""
    _script(tmp_path, "grow", _GROWING_CACHE)
    out = tmp_path / "rec-grow-compiled"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "grow.py", "compiled", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = _replay("step", out, "--step", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:") and "compiled, eager" in r.stdout.splitlines()[0], \
        r.stdout + r.stderr
    assert "departed" not in r.stdout, r.stdout
    eager, _ = _record(tmp_path, "grow")
    r = _replay("step", eager, "--step", "3", "--repeat", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:") and "bits vary" not in r.stdout, r.stdout + r.stderr
