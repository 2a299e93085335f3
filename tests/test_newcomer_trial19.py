"""Found in the twenty-fifth session's second newcomer trial (multi-rank engines nobody adapted),
each a test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _replay, _script

pytestmark = pytest.mark.e2e

# Two pipeline stages: rank 0 embeds and runs the first layer, sends its hidden state; rank 1 runs
# the second and the head, samples and sends the token back. Rank 0 returns {hidden, tokens},
# rank 1 {logits, tokens}: no rank computes what the other does. Nothing differs.
_PIPELINE = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class Stage(nn.Module):
        def __init__(self, rank):
            super().__init__()
            torch.manual_seed(0)
            emb, l0, l1, head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 32)
            self.rank = rank
            if rank == 0:
                self.emb, self.lin = emb, l0
            else:
                self.lin, self.head = l1, head
        def forward(self, x):
            if self.rank == 0:
                h = torch.tanh(self.lin(self.emb(x).mean(0, keepdim=True)))
                dist.send(h, 1)
                tok = torch.zeros(1, dtype=torch.long); dist.recv(tok, 1)
                return {"hidden": h, "tokens": tok}
            h = torch.empty(1, 16); dist.recv(h, 0)
            logits = self.head(torch.tanh(self.lin(h))); tok = logits.argmax(-1)
            dist.send(tok, 0)
            return {"logits": logits, "tokens": tok}

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        st = Stage(rank)
        ids = torch.tensor([4, 9, 1])
        with torch.no_grad():
            for s in range(6):
                ids = torch.cat([ids, st(ids)["tokens"]])
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_pipeline_stages_that_record_different_outputs_are_not_a_divergence_at_step_0(tmp_path: Path) -> None:
    _script(tmp_path, "pp", _PIPELINE)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "pp.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "first divergence at step 0: output.hidden differs on rank(s) 1", a field rank 1
    # never had, and "next: replay step ... --rank 1 --step 0".
    p = _replay("info", rec, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("no divergence: 2 ranks recorded the same bits at every common step in the fields they all record"), first
    assert "output.hidden (rank 0 only), output.logits (rank 1 only)" in first, first
    out = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert out["first_divergence"] is None
    assert out["rank_only_fields"] == {"output.hidden": [0], "output.logits": [1]}
    p = _replay("bisect", "steps", rec, "--no-save", cwd=tmp_path)
    assert p.stdout.startswith("ranks 0, 1 agree at every common step in the fields they all record; not compared"), p.stdout


# Two replicated ranks; from step 3 on rank 1 also returns a field rank 0 never does (it took
# another branch; the first call is not recorded, so that is recorded step 2): a divergence, not ranks of different roles.
_EXTRA_FIELD_LATER = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class M(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0); self.lin = nn.Linear(8, 8)
        def forward(self, x, step: int):
            y = self.lin(x)
            if dist.get_rank() == 1 and step >= 3:
                return {"logits": y, "debug": y * 2}
            return {"logits": y}

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = M(); x = torch.ones(1, 8)
        with torch.no_grad():
            for s in range(5):
                m(x, s)
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_a_field_one_rank_adds_later_is_still_a_divergence(tmp_path: Path) -> None:
    _script(tmp_path, "extra", _EXTRA_FIELD_LATER)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "extra.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = _replay("info", rec, cwd=tmp_path).stdout.splitlines()[0]
    assert first.startswith("first divergence at step 2: output.debug"), first


# Every rank samples its own token and rank 0's is broadcast; from call 6 on, rank 1 samples the
# second-best token (a mistake that persists), but receives rank 0's: every field agrees.
_SAMPLES_OTHERWISE_FROM_THEN_ON = """
    import os, socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class Dec(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0)
            self.emb = nn.Embedding(48, 16); self.head = nn.Linear(16, 48)
            self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        def forward(self, tok):
            logits = self.head(torch.tanh(self.emb(tok)))
            mine = logits.argmax(-1)
            if dist.get_rank() == 1 and int(self.pos) >= 6 and os.environ.get("SAMPLE_BUG", "1") == "1":
                mine = logits.topk(2, -1).indices[:, 1]
            tokv = mine.clone()
            dist.broadcast(tokv, src=0)
            self.pos += 1
            return {"logits": logits, "tokens": tokv}

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = Dec(); tok = torch.tensor([3])
        with torch.no_grad():
            for s in range(12):
                tok = m(tok)["tokens"]
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_a_token_sampled_otherwise_before_a_broadcast_from_then_on_is_a_divergence(tmp_path: Path) -> None:
    _script(tmp_path, "bcast", _SAMPLES_OTHERWISE_FROM_THEN_ON)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "bcast.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "no divergence: 2 ranks recorded the same bits at every common step" (the input
    # differed at 6 of 11 recorded steps: "agrees at most steps" did not hold).
    text = _replay("info", rec, cwd=tmp_path).stdout
    first = text.splitlines()[0]
    assert first.startswith("first divergence at step 5: the input of collective.0.broadcast differs on rank(s) 1"), first
    # Trial 21: the next line's step re-run reproduces (the step's fields agree across the ranks):
    # it says so, and where the input may come from instead.
    nxt = text.splitlines()[-1]
    assert nxt.startswith("next: replay step") and "--rank 1 --step 5" in nxt, nxt
    assert "the program's code around it" in nxt and "--step 5 --between rank:0,rank:1" in nxt, nxt


# A vocab-parallel LM head: each rank holds the head's rows of its half of the vocabulary, and the
# step's own code all_gathers the shards' logits after the head. Nothing differs across ranks.
_VOCAB_PARALLEL = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class VPLM(nn.Module):
        def __init__(self, rank, world):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.emb = nn.Embedding(64, 16); self.mix = nn.Linear(16, 16)
            full_head = torch.randn(64, 16, generator=g)
            with torch.no_grad():
                self.emb.weight.copy_(torch.randn(64, 16, generator=g)); self.mix.weight.copy_(torch.randn(16, 16, generator=g) * 0.3)
                self.mix.bias.zero_()
            self.rank, self.world, shard = rank, world, 64 // world
            self.head = nn.Linear(16, shard, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(full_head[rank * shard:(rank + 1) * shard])
        def forward(self, ids):
            h = torch.tanh(self.mix(self.emb(ids).mean(0, keepdim=True)))
            local = self.head(h)
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local.contiguous())
            logits = torch.cat(parts, -1)
            return {"logits": logits, "tokens": logits.argmax(-1)}

    def build(config, *, rank, world_size, device, options):
        return VPLM(rank, world_size)

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m = VPLM(rank, 2); ids = torch.tensor([5, 9, 2])
        with torch.no_grad():
            for s in range(6):
                ids = torch.cat([ids, m(ids)["tokens"]])
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_bisect_layers_does_not_name_a_vocab_shard_head_whose_logits_are_gathered_in_the_step(tmp_path: Path) -> None:
    _script(tmp_path, "vp", _VOCAB_PARALLEL)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "vp.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert _replay("info", rec, cwd=tmp_path).stdout.startswith("no divergence")
    # Before: "first module that differs: head ...; head receives bitwise equal inputs on both
    # sides and returns different outputs: the difference is made inside it" (the all_gather
    # runs in the step's own code, outside every tapped module, so no shard was told apart).
    p = _replay("bisect", "layers", rec, "--step", 3, "--between", "rank:0,rank:1", "--factory", "vp:build", "--json", "--no-save", cwd=tmp_path)
    out = json.loads(p.stdout)
    head = next(m for m in out["modules"] if m["module"] == "head")
    assert head["rank_local"] is True, head
    assert out.get("maker") in (None, ""), out.get("maker")


# A draft model and a target model in one loop, recorded as two streams; the factory builds one
# module holding both (as an engine holds them).
_DRAFT_AND_TARGET = """
    import torch, torch.nn as nn
    class Draft(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(1); self.lin = nn.Linear(8, 8)
        def forward(self, x): return self.lin(x)
    class Target(nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(2); self.a = nn.Linear(8, 8); self.b = nn.Linear(8, 8)
        def forward(self, x): return self.b(torch.tanh(self.a(x)))
    class Both(nn.Module):
        def __init__(self):
            super().__init__(); self.draft = Draft(); self.target = Target()
    def build(config, *, rank, world_size, device, options):
        return Both()
    if __name__ == "__main__":
        m = Both(); x = torch.ones(1, 8)
        with torch.no_grad():
            for i in range(4):
                x = torch.tanh(m.target(m.draft(x)))
"""


def test_bisect_layers_of_the_second_stream_s_step_rebuilds_that_stream_s_model(tmp_path: Path) -> None:
    _script(tmp_path, "spec", _DRAFT_AND_TARGET)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--step", "spec:Draft", "--step", "spec:Target", "--", sys.executable, "spec.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert len(info["streams"]) == 2, info["streams"]
    # Step 3 is the target's (steps alternate draft, target). Before: "factory spec:build built
    # Both, not an instance of spec:Draft (nor an object holding one)": the first stream's model
    # was rebuilt whatever the step, and a submodule was not looked for.
    p = _replay("bisect", "layers", rec, "--step", 3, "--between", "recorded,rerun", "--factory", "spec:build", "--json", "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert {m["module"] for m in out["modules"]} == {"a", "b"}, out["modules"]


# Data parallel: each rank serves its own prompt; their inputs differ at every step by design.
_DATA_PARALLEL = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(0)
        emb, head = nn.Embedding(32, 8), nn.Linear(8, 32)
        ids = torch.tensor([[1, 2]]) if rank == 0 else torch.tensor([[7, 5]])
        with torch.no_grad():
            for s in range(4):
                ids = torch.cat([ids, head(emb(ids).mean(1)).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_inputs_that_differ_from_the_first_step_say_the_ranks_may_serve_different_requests(tmp_path: Path) -> None:
    _script(tmp_path, "dp", _DATA_PARALLEL)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--step", "torch.nn.modules.linear:Linear", "--", sys.executable, "dp.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = _replay("info", rec, cwd=tmp_path).stdout
    assert "first divergence at step 0: input." in out.splitlines()[0], out
    # Before: only "they differed before it (in the program's set-up, ...)".
    assert "or the ranks serve different requests by design (data parallel)" in out, out


def test_diff_of_runs_whose_only_change_is_a_collective_input_says_different(tmp_path: Path) -> None:
    _script(tmp_path, "bcast", _SAMPLES_OTHERWISE_FROM_THEN_ON)
    ctl, bug = tmp_path / "ctl", tmp_path / "bug"
    for out, flag in ((ctl, "0"), (bug, "1")):
        p = _replay_env({"SAMPLE_BUG": flag}, "record", "--quiet", "--out", out, "--", sys.executable, "bcast.py", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
    # Before: "the same: every field of every step has the same bits", exit 0.
    p = _replay("diff", ctl, bug, cwd=tmp_path)
    assert p.returncode != 0, p.stdout
    assert p.stdout.startswith("different: rank 1 step 5: the input of collective.0.broadcast differs"), p.stdout
    p = _replay("diff", ctl, ctl, cwd=tmp_path)
    assert p.stdout.startswith("the same:") and p.returncode == 0, p.stdout


def _replay_env(extra: dict[str, str], *args: object, cwd: Path):  # noqa: ANN202
    import subprocess

    from tests.test_newcomer_scripts import _env

    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=cwd, env={**_env(), **extra},
                          capture_output=True, text=True, timeout=300)
