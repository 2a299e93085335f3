"""Bugs left from the first two trials and found by the third (issue 15's session 10), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import RERUN_ERROR, _record, _replay, _script

pytestmark = pytest.mark.e2e


def test_bisect_against_the_rerun_names_a_catch_up_step_that_raises_anew(tmp_path: Path) -> None:
    """The engine now raises at step 3 (here: a file it reads appeared since the recording). A
    bisection without a factory scans steps 0..5 in one launch; step 3 is a catch-up step there.
    It is the answer ("first departs at step 3"), not an error that ends the bisection."""
    _script(tmp_path, "drifting", """
        import os, torch, torch.nn as nn
        torch.manual_seed(0)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(40, 16); self.head = nn.Linear(16, 40)
            def forward(self, ids, pos):
                if pos == 3 and os.path.exists("broken"):
                    raise RuntimeError("a config the engine reads now breaks step 3")
                return self.head(self.emb(ids).mean(1))

        m = M().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for pos in range(6):
                tok = m(ids, pos).argmax(-1, keepdim=True)
                ids = torch.cat([ids[:, 1:], tok], 1)
        print("done", ids.tolist())
    """)
    rec, _ = _record(tmp_path, "drifting", "--step", "drifting:M.forward")
    clean = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--json", "--no-save", cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["first"] is None
    (tmp_path / "broken").write_text("")
    res = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--json", "--no-save", cwd=tmp_path)
    assert res.returncode != RERUN_ERROR, res.stderr
    data = json.loads(res.stdout)
    assert (data["first"], data["field"]) == (3, "error"), data
    text = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--no-save", cwd=tmp_path).stdout
    assert "first departs from the recording at step 3 (it raised in the re-run" in text.splitlines()[0], text


_DIRECT = """
    import torch, torch.nn as nn
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__(); self.l = nn.Linear(16, 16)
        def forward(self, h):
            return torch.relu(self.l(h)) + h

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16); self.blocks = nn.ModuleList([Block(), Block()]); self.head = nn.Linear(16, 40)
        def forward(self, ids):
            h = self.emb(ids).mean(1)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    m = M().eval()
    fwd = m.forward
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for pos in range(6):
            tok = CALL(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids[:, 1:], tok], 1)
    print(ids.tolist())
"""


@pytest.mark.smoke
def test_a_model_whose_forward_is_called_directly_is_the_step(tmp_path: Path) -> None:
    """``model.forward(ids)`` skips nn.Module.__call__, so the hooks saw the embedding as the
    outermost module and recorded it as the step: the logits were never recorded or compared."""
    _script(tmp_path, "direct", _DIRECT.replace("CALL", "m.forward"))
    rec = tmp_path / "rec-direct"
    p = _replay("record", "--out", rec, "--", sys.executable, "direct.py", cwd=tmp_path)
    assert "step found with no flags: direct:M (the outermost nn.Module, its forward called directly" in p.stderr, p.stderr
    res = _replay("step", rec, "--step", 3, "--json", "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    vs = json.loads(res.stdout)["modes"]["eager"]["vs_recording"]
    assert list(vs) == ["logits"] and vs["logits"]["verdict"] == "bitwise equal", vs


def test_a_forward_bound_before_recording_is_named_with_the_flag_that_records_it(tmp_path: Path) -> None:
    """``fwd = model.forward`` holds the class's forward as it was: no step can be patched in
    with no flags, and the line says which --step records it (both spellings of the script)."""
    _script(tmp_path, "bound", _DIRECT.replace("CALL", "fwd"))
    out = tmp_path / "rec-bound"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "bound.py", cwd=tmp_path)
    assert "the program calls it through a method bound before recording could patch it" in p.stderr, p.stderr
    assert "--step bound:M.forward" in p.stderr
    shutil.rmtree(out)
    for name in ("bound:M.forward", "__main__:M.forward"):
        rec, _ = _record(tmp_path, "bound", "--step", name)
        text = _replay("info", rec, cwd=tmp_path).stdout
        assert "  0     6      yes" in text, (name, text)
        shutil.rmtree(rec)


def test_tensors_returned_inside_a_list_are_outputs_and_a_large_container_is_named(tmp_path: Path) -> None:
    """``return logits, [h0, h1]``: the list was dropped without a word, so a re-run whose h0
    changed said "bit for bit". Its tensors are now outputs (``out1.0``, ``out1.1``); a container
    over 1 MiB (a cache handed back) is named by the summary as not recorded."""
    _script(tmp_path, "nested", """
        import os, torch, torch.nn as nn
        torch.manual_seed(0)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(40, 16); self.l = nn.Linear(16, 16); self.head = nn.Linear(16, 40)
                self.cache = torch.zeros(300_000)
            def forward(self, ids):
                h0 = self.emb(ids).mean(1); h1 = self.l(h0)
                if os.path.exists("perturb"):
                    h0 = h0 + 1e-3
                return self.head(h1), [h0, h1], (self.cache,)

        m = M().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for pos in range(5):
                logits, hs, cache = m(ids)
                ids = torch.cat([ids[:, 1:], logits.argmax(-1, keepdim=True)], 1)
    """)
    rec = tmp_path / "rec"
    p = _replay("record", "--out", rec, "--", sys.executable, "nested.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "replay: nested:M also returned out2 (a tuple of 1 tensor): not recorded or compared" in p.stderr, p.stderr
    assert "out1" not in p.stderr
    ok = _replay("step", rec, "--step", 2, "--json", "--no-save", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert sorted(json.loads(ok.stdout)["modes"]["eager"]["vs_recording"]) == ["logits", "out1.0", "out1.1"]
    (tmp_path / "perturb").write_text("")
    bad = _replay("step", rec, "--step", 2, "--no-save", cwd=tmp_path)
    assert bad.stdout.startswith("not reproduced") and "out1.0" in bad.stdout.splitlines()[0], bad.stdout


def test_a_function_of_the_script_is_re_run_in_the_re_launched_program(tmp_path: Path) -> None:
    """``--step loop:decode`` names a plain function of the script: the re-run imported the
    script, running its whole loop with replay's own argv (here: KeyError on its argument)."""
    _script(tmp_path, "loop", """
        import sys, torch
        torch.manual_seed(0)
        SIZES = {"small": 16, "big": 32}
        D = SIZES[sys.argv[1]]
        W = torch.randn(D, D) / D ** 0.5

        def decode(w, h):
            return torch.tanh(h @ w)

        h = torch.randn(2, D)
        for i in range(6):
            h = decode(W, h)
        print("done", float(h.sum()))
    """)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--step", "loop:decode", "--", sys.executable, "loop.py", "small",
                cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    res = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("reproduced: rank 0 step 3"), res.stdout
    assert "re-launching the recorded program" in res.stderr and "done" not in res.stdout


def test_a_program_that_changes_directory_is_re_launched_from_where_it_started(tmp_path: Path) -> None:
    """The program chdir()s before its loop: the re-launch ran ``python3 loop.py`` in the new
    directory (no such file), and the re-launched program could not find a relative recording."""
    (tmp_path / "work").mkdir()
    _script(tmp_path, "moving", """
        import os, torch, torch.nn as nn
        torch.manual_seed(0)
        os.chdir("work")

        class LM(nn.Module):
            def __init__(s):
                super().__init__(); s.emb = nn.Embedding(50, 16); s.head = nn.Linear(16, 50)
            def forward(s, x):
                return s.head(s.emb(x)).mean(0, keepdim=True)

        m = LM().eval()
        tok = torch.tensor([1, 2])
        with torch.no_grad():
            for i in range(6):
                tok = torch.cat([tok, m(tok).argmax(-1)])
    """)
    p = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "moving.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    res = _replay("step", "rec", "--step", 3, "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("reproduced: rank 0 step 3"), res.stdout


def test_state_the_loop_changes_between_steps_gets_a_hint_and_keyframes_reproduce_it(tmp_path: Path) -> None:
    """A beam search reorders the model's cache between steps, outside the step: the re-run's
    catch-up cannot see that. It said only "departed at step 1"; it now names the cause and the
    flag, and with a keyframe every step the step reproduces."""
    _script(tmp_path, "beam", """
        import torch, torch.nn as nn
        torch.manual_seed(0)

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 16); self.head = nn.Linear(16, 50)
                self.register_buffer("cache", torch.zeros(3, 16))
            def forward(self, tok):
                self.cache.mul_(0.5).add_(self.emb(tok))
                return self.head(self.cache)

        m = LM().eval()
        tok = torch.tensor([1, 2, 3])
        with torch.no_grad():
            for i in range(6):
                logits = m(tok)
                tok = logits.argmax(-1)
                order = torch.argsort(logits.max(-1).values, descending=True)
                m.cache.copy_(m.cache.index_select(0, order))
    """)
    rec, _ = _record(tmp_path, "beam")
    res = _replay("step", rec, "--step", 4, "--no-save", cwd=tmp_path)
    assert res.stdout.startswith("not reproduced"), res.stdout
    assert "a keyframe every step restores it: replay record --keyframe-every 1" in res.stdout, res.stdout
    shutil.rmtree(rec)
    rec, _ = _record(tmp_path, "beam", "--keyframe-every", "1")
    ok = _replay("step", rec, "--step", 4, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr


_CACHE_OBJECT = """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)

    class Cache:
        def __init__(self):
            self.kv = torch.zeros(1, 16)
        def update(self, x):
            self.kv = self.kv + x
            return self.kv

    class LM(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(50, 16); self.head = nn.Linear(16, 50)
        def forward(self, tok, cache):
            return self.head(cache.update(self.emb(tok)))

    m, cache = LM().eval(), Cache()
    tok = torch.tensor([1])
    with torch.no_grad():
        for i in range(12):
            tok = m(tok, cache).argmax(-1)
            if sys.argv[1:] == ["between"]:
                cache.kv = cache.kv * 0.5  # the loop changes the object between steps
"""


@pytest.mark.smoke
def test_a_cache_object_argument_is_filled_by_re_running_the_steps_from_step_0(tmp_path: Path) -> None:
    """``model(tok, cache)`` with a cache object that has methods (HF's DynamicCache under
    ``generate()``), found with no flags: recorded by class name only. The re-launched program
    runs the call discovery chose the step at (not recorded) itself, and the re-run fills the
    program's own cache by re-running steps 0.. (past the keyframe at step 8). Before: the
    re-run took the program's first call as step 0 and restored the keyframe: never reproduced."""
    _script(tmp_path, "cacheobj", _CACHE_OBJECT)
    rec = tmp_path / "rec"
    p = _replay("record", "--keyframe-every", 4, "--out", rec, "--", sys.executable, "cacheobj.py", cwd=tmp_path)
    assert "replay: cacheobj:LM takes cache (a Cache), recorded by class name only" in p.stderr, p.stderr
    res = _replay("step", rec, "--step", 9, "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert res.stdout.startswith("reproduced") and "bit for bit" in res.stdout, res.stdout
    assert "caught up from step 0: cache (a Cache) is the program's own object" in res.stdout, res.stdout


def test_a_difference_over_a_cache_object_changed_between_steps_says_so(tmp_path: Path) -> None:
    """The same loop changing the cache between steps (outside the step, as a beam search
    reorders its cache): not reproduced, and the line says the difference may be that object's
    contents, not the program's."""
    _script(tmp_path, "cacheobj", _CACHE_OBJECT)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "cacheobj.py", "between", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = _replay("step", rec, "--step", 3, "--no-save", cwd=tmp_path)
    head = res.stdout.splitlines()[0]
    assert res.returncode == 0 and head.startswith("not reproduced"), head  # compared: a difference is a result
    assert "the step's argument cache (a Cache) was not recorded" in head, head


@pytest.mark.smoke
def test_hf_generate_with_no_flags_re_runs_a_decode_step_bit_for_bit(tmp_path: Path) -> None:
    """``model.generate()`` of a small random Llama, recorded with no flags: the prefill chooses
    the step, its DynamicCache is the program's own at the re-run, and a decode step past the
    first keyframe re-runs bit for bit. Before: "not reproduced" for a deterministic program."""
    pytest.importorskip("transformers")
    _script(tmp_path, "gen", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        m = LlamaForCausalLM(cfg).eval()
        out = m.generate(torch.randint(0, 128, (2, 5)), max_new_tokens=14, do_sample=False, pad_token_id=0)
        print(out[:, -3:].tolist())
    """)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--keyframe-every", 5, "--out", rec, "--", sys.executable, "gen.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    res = _replay("step", rec, "--step", 11, "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert res.stdout.startswith("reproduced") and "bit for bit" in res.stdout, res.stdout
