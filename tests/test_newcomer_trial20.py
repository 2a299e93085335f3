"""Found in the twenty-fifth session's third newcomer trial (engines nobody adapted), each a test
that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _replay, _script

pytestmark = pytest.mark.e2e

# Speculative decoding as one function step, spec_step(target, draft, ids): the target is the
# step's model; the draft, a second model, is passed beside it. DSEED perturbs the draft only.
_SPEC_STEP = """
    import os, torch, torch.nn as nn
    class LM(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32)
        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids).cumsum(1)))
    target, draft = LM().eval(), LM().eval()
    with torch.no_grad():
        draft.head.weight.add_(torch.randn(32, 16, generator=torch.Generator().manual_seed(int(os.environ.get("DSEED", "9")))) * 0.3)
    def spec_step(target, draft, ids):
        d = ids
        for _ in range(2):
            d = torch.cat([d, draft(d)[:, -1:].argmax(-1)], 1)
        return target(d)[:, -1].argmax(-1, keepdim=True)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for s in range(5):
            ids = torch.cat([ids, spec_step(target, draft, ids)], 1)
"""


def test_diff_does_not_call_the_weights_the_same_for_a_model_the_step_takes_unrecorded(tmp_path: Path) -> None:
    import subprocess

    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "spec", _SPEC_STEP)
    for out, seed in (("recA", "9"), ("recB", "5")):
        p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--step", "spec:spec_step", "--out", out, "--",
                            sys.executable, "spec.py"], cwd=tmp_path, env={**_env(), "DSEED": seed}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    # Before: "weights  the same (as at each run's first recorded step)": the draft, whose
    # weights differ, was never digested.
    out = json.loads(_replay("diff", "recA", "recB", "--json", cwd=tmp_path).stdout)
    weights = next(c for c in out["other_differences"] if c["category"] == "weights")
    assert "the step's model only: it also takes draft (a LM), recorded by class name only" in weights["note"], weights


# Two LoRA adapters; the loop picks one per request by name (a str attribute) before each step.
_LORA_BY_NAME = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    class LoRA(nn.Module):
        def __init__(self, seed):
            super().__init__(); g = torch.Generator().manual_seed(seed)
            self.A = nn.Parameter(torch.randn(4, 16, generator=g) * 0.3); self.B = nn.Parameter(torch.randn(16, 4, generator=g) * 0.3)
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16); self.l1 = nn.Linear(16, 16); self.head = nn.Linear(16, 32)
            self.adapters = nn.ModuleDict({"a": LoRA(1), "b": LoRA(2)})
            self.active = "a"
        def forward(self, ids):
            h = self.emb(ids).mean(1); ad = self.adapters[self.active]
            return self.head(torch.relu(self.l1(h) + h @ ad.A.T @ ad.B.T))
    m = LM().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for r in ["a", "b", "a", "a", "b", "b", "a", "b"]:
            m.active = r
            ids = torch.cat([ids, m(ids).argmax(-1, keepdim=True)], 1)
"""


def test_a_str_attribute_the_loop_sets_between_steps_is_kept_in_keyframes(tmp_path: Path) -> None:
    _script(tmp_path, "lora", _LORA_BY_NAME)
    p = _replay("record", "--quiet", "--keyframe-every", 1, "--out", "rec", "--", sys.executable, "lora.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "not reproduced" even with a keyframe every step (the advice `replay step` gives):
    # keyframes kept int, float and bool attributes only, and the adapter's name is a str.
    for step in (3, 5):
        p = _replay("step", "rec", "--rank", 0, "--step", step, "--no-save", cwd=tmp_path)
        assert p.stdout.startswith(f"reproduced: rank 0 step {step} re-ran bit for bit"), p.stdout


# The loop all-reduces the sampled token after each call of the model (outside the step); from
# call 5 on, rank 1's logits are pushed to another token.
_ALL_REDUCE_AFTER_THE_STEP = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0); self.emb = nn.Embedding(32, 8); self.head = nn.Linear(8, 32)
            self.calls = 0
        def forward(self, ids):
            self.calls += 1
            logits = self.head(self.emb(ids).mean(1))
            if dist.get_rank() == 1 and self.calls >= 5:
                logits = logits.clone(); logits[0, (int(logits.argmax()) + 1) % 32] += 100.0
            return logits

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = LM(); ids = torch.tensor([[1, 2]])
        with torch.no_grad():
            for s in range(8):
                nxt = m(ids).argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
                t = nxt.clone().view(1); dist.all_reduce(t)
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_a_collective_the_loop_makes_after_the_step_is_not_named_before_the_step_s_output(tmp_path: Path) -> None:
    _script(tmp_path, "after", _ALL_REDUCE_AFTER_THE_STEP)
    p = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "after.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "first divergence at step 3: the input of collective.0.all_reduce differs ...;
    # every rank received the same output, which hides the difference from the fields after it",
    # where the step's own logits (recorded before that all_reduce ran) differ.
    first = _replay("info", "rec", cwd=tmp_path).stdout.splitlines()[0]
    assert first.startswith("first divergence at step 3: output.logits differs on rank(s) 1"), first
