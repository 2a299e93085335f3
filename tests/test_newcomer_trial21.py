"""Findings of the twenty-first newcomer trial (engines the tool was not written for): each test
fails on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# An engine module holding the language model as ``self.lm``: recorded with ``--modules lm`` (bisect's
# hooks on the model's modules), the recorder digests the engine's parameters (``lm.emb.weight``).
_ENGINE = textwrap.dedent("""
    import torch, torch.nn as nn
    torch.set_num_threads(1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16); self.mlp = nn.Linear(16, 16); self.head = nn.Linear(16, 32)

        def forward(self, ids):
            return self.head(torch.tanh(self.mlp(self.emb(ids).mean(1))))

    class Engine(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids)

    def build(config=None, *, rank=0, world_size=1, device="cpu", options=None):
        torch.manual_seed(0)
        return Engine(LM().eval())

    if __name__ == "__main__":
        e = build()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(5):
                t = e(ids).argmax(-1, keepdim=True)
                ids = torch.cat([ids, t], 1)
        print(ids.tolist())
""")


def _env(cwd: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(cwd)])
    return env


def _replay(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env=_env(cwd), capture_output=True, text=True,
                          timeout=180)


@pytest.mark.e2e
def test_modules_naming_a_submodule_does_not_make_the_weights_differ(tmp_path):
    (tmp_path / "wrapped_engine.py").write_text(_ENGINE)
    rec = _replay("record", "--quiet", "--out", "rec", "--step", "wrapped_engine:Engine", "--factory", "wrapped_engine:build",
                  "--modules", "lm", "--", sys.executable, "wrapped_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    r = _replay("step", "rec", "--step", "2", "--no-save", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    w = d.get("weights") or {}
    # Before: "24 are not in the rebuilt model (lm.emb.weight, ...); 24 were not recorded (emb.weight, ...)".
    assert w.get("checked") and not w.get("differ") and not w.get("missing") and not w.get("extra"), w
    assert d["headline"].startswith("reproduced"), d["headline"]


@pytest.mark.e2e
def test_info_of_one_rank_says_nothing_was_compared_once(tmp_path):
    (tmp_path / "wrapped_engine.py").write_text(_ENGINE)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "wrapped_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    r = _replay("info", "rec", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("one rank: nothing to compare across ranks"), r.stdout
    assert r.stdout.count("nothing to compare across ranks") == 1, r.stdout


class _Flagged(torch.nn.Module):
    """A layer whose behaviour a flag set by the loop switches (``model.layers[1].mlp.bug = True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bug = False

    def forward(self, x):
        return self.lin(x) + (1e-3 if self.bug else 0.0)


class _HoldsModel:
    def __init__(self, lm: torch.nn.Module) -> None:
        self.lm = lm


@pytest.mark.parametrize("held", [False, True], ids=["module", "engine-holding-its-model"])
def test_keyframes_keep_a_flag_the_loop_sets_on_a_submodule(held):
    """Before, keyframes kept the target's own attributes only: `replay step` advised
    `--keyframe-every 1`, which then did not restore the flag (not reproduced again)."""
    from replay.core.state import restore_scalars, split_scalars, with_scalars

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Flagged())
        return _HoldsModel(model) if held else model

    obj = build()
    model = obj.lm if held else obj
    keyframe = with_scalars(lambda: {}, lambda: obj)
    first = keyframe()
    key = "__py__.lm.1.bug" if held else "__py__.1.bug"
    assert key not in first
    model[1].bug = True
    at_bug = keyframe()
    assert at_bug[key].item() is True, sorted(at_bug)
    # A submodule's attribute that never changed (a layer's size) is not kept.
    assert not any("in_features" in k for k in at_bug), sorted(at_bug)
    model[1].bug = False
    after = keyframe()
    assert after[key].item() is False  # set back: kept, so a keyframe after it restores it too

    fresh = build()
    _, scalars = split_scalars(at_bug)
    assert restore_scalars(fresh, scalars) == []
    assert (fresh.lm if held else fresh)[1].bug is True


# Tensor parallel: each rank holds half the hidden units of an MLP and all_reduces its partial
# sum inside the step. The partial sums differ across the ranks at every step, by design.
_TENSOR_PARALLEL = textwrap.dedent("""
    import os, socket, sys, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_num_threads(1)

    class TPMLP(nn.Module):
        def __init__(self, rank):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16); self.fc1 = nn.Linear(16, 32); self.fc2 = nn.Linear(32, 16); self.head = nn.Linear(16, 32)
            half = slice(16 * rank, 16 * (rank + 1))
            with torch.no_grad():
                self.fc1.weight = nn.Parameter(self.fc1.weight[half].clone()); self.fc1.bias = nn.Parameter(self.fc1.bias[half].clone())
                self.fc2.weight = nn.Parameter(self.fc2.weight[:, half].clone())
                if rank:
                    self.fc2.bias.zero_()

        def forward(self, ids):
            y = self.fc2(torch.tanh(self.fc1(self.emb(ids).mean(1))))
            dist.all_reduce(y)
            return self.head(y)

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = TPMLP(rank).eval(); ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(6):
                t = m(ids).argmax(-1, keepdim=True); ids = torch.cat([ids, t], 1)
        print(rank, ids.tolist(), flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        mp.spawn(worker, args=(port,), nprocs=2)
""")


@pytest.mark.e2e
def test_no_divergence_names_the_collective_inputs_it_left_out(tmp_path):
    (tmp_path / "tp_engine.py").write_text(_TENSOR_PARALLEL)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "tp_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    first = _replay("info", "rec", cwd=tmp_path).stdout.splitlines()[0]
    # Before: "no divergence: 2 ranks recorded the same bits at every common step", while the
    # recorded all_reduce inputs (the partial sums) differ at every step.
    assert first.startswith("no divergence: 2 ranks"), first
    assert "not compared: the inputs of collective.0.all_reduce" in first, first


# Rank 1's prefill (the module's first call, not recorded with no flags) leaves another state:
# the first recorded step's outputs differ with the same inputs.
_PREFILL_BUG = textwrap.dedent("""
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_num_threads(1)

    class LM(nn.Module):
        def __init__(self, rank):
            super().__init__()
            torch.manual_seed(0)
            self.rank = rank
            self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32)
            self.register_buffer("carry", torch.zeros(16))

        def forward(self, ids):
            h = self.emb(ids).mean(1)
            if ids.shape[1] > 1:  # the prefill
                self.carry += h[0] * (1.001 if self.rank == 1 else 1.0)
            return self.head(h + self.carry)

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = LM(rank).eval()
        with torch.no_grad():
            t = m(torch.tensor([[1, 2, 3]])).argmax(-1, keepdim=True)
            for _ in range(4):
                t = m(t).argmax(-1, keepdim=True)
                dist.broadcast(t, 0)
        dist.destroy_process_group()

    if __name__ == "__main__":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        mp.spawn(worker, args=(port,), nprocs=2)
""")


@pytest.mark.e2e
def test_a_divergence_at_step_0_names_the_unrecorded_first_call(tmp_path):
    (tmp_path / "prefill_engine.py").write_text(_PREFILL_BUG)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "prefill_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    text = _replay("info", "rec", cwd=tmp_path).stdout
    assert text.startswith("first divergence at step 0: output.logits differs on rank(s) 1"), text
    # Before: nothing said that rank 1's first call ran unrecorded, and `replay step --step 0`
    # then reproduced.
    assert "rank 1 called the step 1 time before its step 0, not recorded" in text, text
    assert "replay record --step prefill_engine:LM" in text, text
    # And the step line says the numbering starts at the program's second call.
    step_line = next(line for line in text.splitlines() if line.startswith("step "))
    assert "recorded from its second call" in step_line, step_line


_ENV_BUG = textwrap.dedent("""
    import os, torch, torch.nn as nn
    torch.set_num_threads(1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32); self.calls = 0

        def forward(self, ids):
            self.calls += 1
            out = self.head(self.emb(ids).mean(1))
            return out + (1.0 if os.environ.get("STEP_BUG") == "1" and self.calls == 5 else 0.0)

    m = LM().eval(); ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, m(ids).argmax(-1, keepdim=True)], 1)
    print(ids.tolist())
""")


@pytest.mark.e2e
def test_bisect_steps_names_the_environment_not_a_keyframe_remedy_the_recording_has(tmp_path):
    """Trial 22: a recording made with --keyframe-every 1 and a variable set (the program's bug)
    was told "a keyframe every step restores it: replay record --keyframe-every 1"."""
    (tmp_path / "env_engine.py").write_text(_ENV_BUG)
    rec = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--keyframe-every", "1", "--out", "rec", "--",
                          sys.executable, "env_engine.py"], cwd=tmp_path, env={**_env(tmp_path), "STEP_BUG": "1"},
                         capture_output=True, text=True, timeout=180)
    assert rec.returncode == 0, rec.stderr
    b = _replay("bisect", "steps", "rec", "--against-rerun", "--no-save", cwd=tmp_path)
    assert "departs at 3" in b.stdout or "departed at step 3" in b.stdout, b.stdout + b.stderr
    assert "--keyframe-every 1" not in b.stdout, b.stdout
    assert "the environment here differs from the recorded program's in STEP_BUG" in b.stdout, b.stdout


_PATCHED_FORWARD = textwrap.dedent("""
    import torch, torch.nn as nn
    torch.set_num_threads(1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16); self.head = nn.Linear(16, 32)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    _orig = LM.forward

    def fwd(self, ids):  # a patched forward (a fused kernel's patch, say), calling the original
        return _orig(self, ids) * 1.0

    LM.forward = fwd
    m = LM().eval(); ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, m(ids).argmax(-1, keepdim=True)], 1)
    print(ids.tolist())
""")


@pytest.mark.e2e
def test_a_step_whose_class_forward_the_program_patched_is_re_run(tmp_path):
    """Trial 22: `LM.forward = fwd` (fwd calling the original): recorded, then every re-run
    failed with "cannot find the function of LM.forward in the re-launched program"."""
    (tmp_path / "patched_engine.py").write_text(_PATCHED_FORWARD)
    rec = _replay("record", "--quiet", "--out", "rec", "--", sys.executable, "patched_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr
    r = _replay("step", "rec", "--step", "2", "--no-save", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("reproduced:"), r.stdout + r.stderr


def test_the_verdict_over_ranks_says_whether_their_collectives_ran_live():
    """Trial 22: `step --ranks 0-1` printed the same line with recorded and with live collectives."""
    from replay.cli.step import _ranks_headline

    ok = {"headline": "reproduced: rank 0 step 4 re-ran bit for bit in eager"}
    live = _ranks_headline([{**ok, "rank": 0, "collectives": "live"}, {**ok, "rank": 1, "collectives": "live"}], 4)
    alone = _ranks_headline([{**ok, "rank": 0, "collectives": "recorded"}, {**ok, "rank": 1, "collectives": "recorded"}], 4)
    assert live == "reproduced: step 4 of rank(s) 0, 1, together, their collectives live between them", live
    assert alone.startswith("reproduced: step 4 of rank(s) 0, 1, each alone against its own recording"), alone


# The loop sets a flag on one layer of rank 1's model before one step (a runner that turns the
# cache off for a step): nothing recorded as config or weights differs across the ranks.
_SUBMODULE_FLAG = textwrap.dedent("""
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16); self.use_cache = True

        def forward(self, x):
            return self.lin(x) * (1.0 if self.use_cache else 1.001)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(32, 16); self.blocks = nn.ModuleList([Block(), Block()]); self.head = nn.Linear(16, 32)

        def forward(self, ids):
            h = self.emb(ids).mean(1)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = LM().eval(); t = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for i in range(6):
                m.blocks[1].use_cache = not (rank == 1 and i == 4)
                t = m(t).argmax(-1, keepdim=True)
                dist.broadcast(t, 0)
        dist.destroy_process_group()

    if __name__ == "__main__":
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        mp.spawn(worker, args=(port,), nprocs=2)
""")


@pytest.mark.e2e
def test_info_names_a_submodule_flag_one_rank_set_otherwise(tmp_path):
    """Trial 22: keyframes held rank 1's `blocks.1.use_cache=False`, and `replay step` restored
    it, but neither info nor diff named it: config and weights are the same on both ranks."""
    (tmp_path / "flag_engine.py").write_text(_SUBMODULE_FLAG)
    rec = _replay("record", "--quiet", "--keyframe-every", "1", "--out", "rec", "--", sys.executable, "flag_engine.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    text = _replay("info", "rec", cwd=tmp_path).stdout
    assert text.startswith("first divergence at step 3: output.logits differs on rank(s) 1"), text
    assert ("rank 1's keyframe at step 3 holds Python state other than rank 0's (at step 3): blocks.1.use_cache False "
            "(rank 0: unchanged since its first keyframe)") in text, text
