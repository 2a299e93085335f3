"""Bugs found by the fourth newcomer trial (issue 15's session 11), each a test that failed
before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _env, _replay, _script
from tests.test_newcomer_trial3 import _CACHE_OBJECT

pytestmark = pytest.mark.e2e


def test_each_object_recorded_by_class_name_has_its_own_number() -> None:
    """The record of an argument kept by class name only says which object it was (the first,
    the second...): a re-run tells a second ``generate()``'s new cache from the first's."""
    from replay.record.calls import _jsonable

    class Cache:
        pass

    a, b = Cache(), Cache()
    first, second, again = _jsonable(a), _jsonable(b), _jsonable(a)
    assert first["unrecorded"] == second["unrecorded"] == "Cache"
    assert first == again and first["object"] != second["object"]


_TWICE = """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for prompt in ([[5, 6, 7]], [[100, 101, 102, 103]]):
            out = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=None)
            print(out[0].tolist())
"""


@pytest.mark.smoke
def test_a_second_generate_s_steps_re_run_from_the_program_s_own_state(tmp_path: Path) -> None:
    """Two ``generate()`` calls in one process, no flags: one part, steps 0..6 the first call's
    decode steps, 7 the second call's prefill with a new DynamicCache. A step of the second call
    re-runs bit for bit from the program's own state at step 7 (before: every step of the second
    call "not reproduced", the first call's cache fed to it), and ``bisect steps
    --against-rerun`` scans each cache's steps in a launch of its own and finds no departure
    (before: "first departs at step 7")."""
    pytest.importorskip("transformers")
    _script(tmp_path, "twice", _TWICE)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "twice.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)["ranks"][0]["steps"] == 15
    res = _replay("step", rec, "--step", 10, "--no-save", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert res.stdout.startswith("reproduced") and "bit for bit" in res.stdout, res.stdout
    assert "from the program's own state at step 7 (no keyframe restored)" in res.stdout, res.stdout
    b = _replay("bisect", "steps", "--against-rerun", rec, "--no-save", "--json", cwd=tmp_path)
    assert b.returncode == 0, b.stdout + b.stderr[-2000:]
    found = json.loads(b.stdout)
    assert found["first"] is None and found["exhaustive"], found
    assert [(p["from"], p["to"]) for p in found["probes"]] == [(0, 6), (7, 14)], found["probes"]


def test_bisect_names_a_cache_object_at_the_departure_and_step_offers_no_keyframe_hint(tmp_path: Path) -> None:
    """A loop that changes its cache object between steps (as a beam search reorders its
    cache): ``bisect steps --against-rerun`` says the departure may be that object's contents
    (before: a bare "first departs at step N"), and ``replay step`` no longer offers
    ``--keyframe-every 1``, which cannot restore an object recorded by class name only."""
    _script(tmp_path, "cacheobj", _CACHE_OBJECT)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--keyframe-every", 1, "--out", rec, "--", sys.executable, "cacheobj.py", "between",
                cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    b = _replay("bisect", "steps", "--against-rerun", rec, "--no-save", cwd=tmp_path)
    head = b.stdout.splitlines()[0]
    assert "first departs from the recording at step 1" in head, b.stdout + b.stderr[-1500:]
    assert "but the step takes cache (a Cache), recorded by class name only" in head, head
    s = _replay("step", rec, "--step", 4, "--no-save", cwd=tmp_path)
    assert s.stdout.startswith("not reproduced"), s.stdout
    assert "--keyframe-every 1" not in s.stdout, s.stdout


_INT_STEP = """
    import sys, torch, torch.nn as nn
    V, D = 64, 16

    class Decoder:
        def __init__(self):
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
            self.tok, self.n = torch.tensor([3]), 0
            self.temp = float(sys.argv[1])

        @torch.no_grad()
        def step(self):
            logits = self.head(self.emb(self.tok))
            g = torch.Generator().manual_seed(self.n)
            self.tok = torch.multinomial(torch.softmax(logits / self.temp, -1), 1, generator=g)[0]
            self.n += 1
            return self.tok.item()  # the token as a Python int

    d = Decoder()
    print([d.step() for _ in range(12)])
"""


def test_a_step_returning_a_python_number_is_recorded_and_compared(tmp_path: Path) -> None:
    """``return tok.item()``: the int is the step's output, recorded and compared (before:
    "not compared ... the re-run returned nothing"), and ``diff`` finds where two runs that
    sample differently first differ (before: "not shown to be the same", its row "the same")."""
    _script(tmp_path, "intstep", _INT_STEP)
    recs = {}
    for name, temp in (("a", "1.0"), ("b", "0.2")):
        recs[name] = tmp_path / f"rec-{name}"
        p = _replay("record", "--quiet", "--out", recs[name], "--step", "intstep:Decoder.step", "--", sys.executable,
                    "intstep.py", temp, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", recs["a"], "--step", 6, "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced") and "bit for bit" in s.stdout, s.stdout + s.stderr[-1500:]
    d = json.loads(_replay("diff", recs["a"], recs["b"], "--json", cwd=tmp_path).stdout)
    # The sampled token a step returns alone is a token field (twenty-second session: it was
    # ``output.output``, and info said no token field was recorded).
    assert d["verdict"] == "different" and d["streams"][0]["first_difference"]["field"] == "tokens.output", d


def test_a_diff_of_runs_that_recorded_only_inputs_says_so_on_every_row(tmp_path: Path) -> None:
    """Steps that return nothing and write nothing: the headline is "not shown to be the same",
    and so is each stream's row (before: the row said "the same")."""
    _script(tmp_path, "noout", """
        import torch
        class Acc:
            def __init__(self): self.total = 0.0
            def step(self, x): self.total += float(x.sum())
        a = Acc()
        for i in range(5):
            a.step(torch.arange(4.0) + i)
        print(a.total)
    """)
    recs = []
    for name in ("a", "b"):
        recs.append(tmp_path / f"rec-{name}")
        p = _replay("record", "--quiet", "--out", recs[-1], "--step", "noout:Acc.step", "--", sys.executable, "noout.py",
                    cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(_replay("diff", *recs, "--json", cwd=tmp_path).stdout)
    assert d["verdict"] == "not shown to be the same", d
    assert [s["verdict"] for s in d["streams"]] == ["not shown to be the same"], d["streams"]


_PAGED = """
    import torch, torch.nn as nn
    V, D, BS, NB = 48, 16, 4, 16

    class Engine:
        def __init__(self):
            torch.manual_seed(0)
            self.emb, self.qkv, self.head = nn.Embedding(V, D), nn.Linear(D, 3 * D), nn.Linear(D, V)
            self.kv = torch.zeros(2, NB * BS, D)  # k/v, slots, D: a paged pool
            self.block_table = torch.full((NB,), -1, dtype=torch.int64)
            self.next_block = 0

        @torch.no_grad()
        def step(self, tok, pos):
            if pos % BS == 0:
                self.block_table[pos // BS] = self.next_block; self.next_block += 1
            x = self.emb(tok); q, k, v = self.qkv(x).chunk(3, -1)
            slot = int(self.block_table[pos // BS]) * BS + pos % BS
            self.kv[0, slot], self.kv[1, slot] = k, v
            idx = torch.arange(pos + 1); sl = self.block_table[idx // BS] * BS + idx % BS
            w = torch.softmax(self.kv[0, sl] @ q / D ** 0.5, 0)
            return self.head(x + w @ self.kv[1, sl])

    eng, tok = Engine(), torch.tensor(3)
    for pos in range(14):
        tok = eng.step(tok, pos).argmax()
    print(int(tok))
"""


def test_state_naming_a_tensor_attribute_is_kept_in_keyframes(tmp_path: Path) -> None:
    """``--state kv`` naming a tensor (a paged KV pool): kept in keyframes under its name
    (before: "recording stopped: RuntimeError: Boolean value of Tensor ..." and nothing
    recorded). The pool alone is not all the state (the block table is too): a step after the
    keyframe departs at the keyframe's own step: the step is re-run from step 0 then (the
    program's own block table runs on), and a note says what the keyframe lacks."""
    _script(tmp_path, "paged", _PAGED)
    rec = tmp_path / "rec"
    p = _replay("record", "--keyframe-every", 8, "--out", rec, "--step", "paged:Engine.step", "--state", "kv", "--",
                sys.executable, "paged.py", cwd=tmp_path)
    assert p.returncode == 0 and "recording stopped" not in p.stderr, p.stderr[-2000:]
    assert json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)["ranks"][0]["steps"] == 14
    ok = _replay("step", rec, "--step", 5, "--no-save", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr[-1500:]
    again = _replay("step", rec, "--step", 10, "--no-save", cwd=tmp_path)
    assert again.stdout.startswith("reproduced"), again.stdout + again.stderr[-1500:]
    assert "from the keyframe at step 8 the re-run departed at that step itself" in again.stdout, again.stdout
    assert "the keyframe does not hold all the state the step reads (name the rest with replay record --state" in again.stdout
    assert "--keyframe-every 1" not in again.stdout, again.stdout


def _replay_env(*args: object, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``_replay`` with variables added to (or, valued None, removed from) its environment."""
    e = {**_env(), **{k: v for k, v in env.items() if v is not None}}
    for k in (k for k, v in env.items() if v is None):
        e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=300)


def test_a_re_launched_program_missing_a_recorded_variable_is_told_apart_from_the_program(tmp_path: Path) -> None:
    """A loop that reads ``LORA=1`` to add a delta to its weights (``functional_call`` with
    other parameters), recorded with it and re-run from a shell without it: the re-launched
    program computes something else, and ``replay step`` names the variable and the weights
    that differ (before: a bare "not reproduced" with a --keyframe-every hint), and ``bisect
    steps`` the weights. With the variable set as it was, it reproduces. The recording holds the
    variable's name and a digest, never its value."""
    _script(tmp_path, "fcall", """
        import os, torch, torch.nn as nn
        from torch.func import functional_call
        class M(nn.Module):
            def __init__(self):
                super().__init__(); self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32)
            def forward(self, tok):
                return self.head(self.emb(tok))
        torch.manual_seed(0)
        m = M().eval()
        params = {k: v.detach().clone() for k, v in m.named_parameters()}
        if os.environ.get("LORA"):
            params["head.weight"] = params["head.weight"] + 1e-3 * torch.randn_like(params["head.weight"])
        tok = torch.tensor([7])
        with torch.no_grad():
            for i in range(8):
                tok = functional_call(m, params, (tok,)).argmax(-1)
        print(tok.tolist())
    """)
    rec = tmp_path / "rec"
    p = _replay_env("record", "--quiet", "--out", rec, "--", sys.executable, "fcall.py", cwd=tmp_path,
                    env={"LORA": "1", "MY_API_TOKEN": "s3cret-value"})
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay_env("step", rec, "--step", 3, "--no-save", cwd=tmp_path, env={"LORA": None})
    head = s.stdout.splitlines()[0]
    assert head.startswith("not reproduced"), s.stdout + s.stderr[-1500:]
    assert "environment differs from the recorded one in LORA (not set here)" in head, head
    assert "but the step ran with other weights than the re-run's (1 differ: head.weight)" in head, head
    b = _replay_env("bisect", "steps", "--against-rerun", rec, "--no-save", cwd=tmp_path, env={"LORA": None})
    assert "but the steps ran with other weights than the re-run's (1 differ: head.weight)" in b.stdout.splitlines()[0], b.stdout
    ok = _replay_env("step", rec, "--step", 3, "--no-save", cwd=tmp_path, env={"LORA": "1"})
    assert ok.stdout.startswith("reproduced"), ok.stdout + ok.stderr[-1500:]
    raw = b"".join(f.read_bytes() for f in rec.rglob("*") if f.is_file())
    assert b"s3cret-value" not in raw and b"MY_API_TOKEN" not in raw


_DRAFT_AND_TARGET = """
    import torch
    torch.manual_seed(0)

    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 16)
            self.head = torch.nn.Linear(16, 64)
        def forward(self, ids):
            return self.head(self.emb(ids))

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.head = torch.nn.Linear(32, 64)
        def forward(self, ids):
            return self.head(self.emb(ids))

    draft, target = Draft().eval(), Target().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(6):
            guess = draft(ids)[:, -1].argmax(-1, keepdim=True)
            verify = target(torch.cat([ids, guess], 1))[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, verify], 1)
    print(ids.tolist())
"""


def test_a_target_model_beside_the_draft_chosen_with_no_flags_is_named(tmp_path: Path) -> None:
    """Speculative decoding with no flags: the draft is called first and chosen; the target,
    called as often at the top level, is not recorded. ``replay record`` says so and prints the
    command that records both (before: the target was never mentioned)."""
    _script(tmp_path, "spec", _DRAFT_AND_TARGET)
    rec = tmp_path / "rec"
    p = _replay("record", "--out", rec, "--", sys.executable, "spec.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next((x for x in p.stderr.splitlines() if "not recorded" in x and "Target" in x), None)
    assert line is not None, p.stderr[-2000:]
    assert "--step spec:Draft --step spec:Target" in line, line
    # The command it prints records both models.
    both = tmp_path / "both"
    p = _replay("record", "--quiet", "--out", both, "--step", "spec:Draft", "--step", "spec:Target",
                "--", sys.executable, "spec.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(_replay("info", both, "--json", cwd=tmp_path).stdout)
    assert info["ranks"][0]["steps"] == 12, info["ranks"][0]
