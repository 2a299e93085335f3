"""Found in the twenty-third and twenty-fourth sessions' newcomer trials (engines nobody adapted),
each a test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _replay, _script

pytestmark = pytest.mark.e2e

# Two gloo ranks decode with a model whose blocks add a buffer; a warm-up before the loop left
# rank 1's buffer of block 1 off by 1e-3 (state set before the recording's first step).
_STATE_OFF_BEFORE_THE_LOOP = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.register_buffer("h", torch.zeros(16))
        def forward(self, x):
            return x + torch.tanh(self.lin(x)) + self.h

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
        def forward(self, ids):
            x = self.emb(ids).mean(1)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def build(config, *, rank, world_size, device, options):
        return LM().eval()

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM().eval()
        if rank == 1:
            model.blocks[1].h.add_(1e-3)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_bisect_layers_says_a_modules_state_already_differed_when_the_step_began(tmp_path: Path) -> None:
    """`bisect layers --between rank:0,rank:1` said "blocks.1 receives bitwise equal inputs on
    both sides and returns different outputs: the difference is made inside it" where the
    module's code does nothing rank-specific: its buffer already differed in the keyframes (set
    before the loop). It names the buffer, and says the difference is carried in, not made."""
    _script(tmp_path, "carried", _STATE_OFF_BEFORE_THE_LOOP)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", sys.executable, "carried.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    p = _replay("bisect", "layers", out, "--between", "rank:0,rank:1", "--factory", "carried:build", "--no-save", "--json",
                cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["first"] == "blocks.1" and d["maker"] == "blocks.1", d
    assert d["state_differs"] == ["blocks.1.h"], d
    assert "its state already differs when the step begins (buffer blocks.1.h" in d["origin"], d["origin"]
    assert "made inside it" not in d["origin"], d["origin"]
    text = _replay("bisect", "layers", out, "--between", "rank:0,rank:1", "--factory", "carried:build", "--no-save",
                   cwd=tmp_path)
    assert "but its state already differs when the step begins: buffer blocks.1.h" in text.stdout.splitlines()[0], text.stdout


# The same replicated model on 1 or 2 gloo ranks (argv: world size, and "off" to change the head's
# weights by 1e-3: a checkpoint that differs between the two deployments).
_REPLICATED_ON_ANY_WORLD = """
    import socket, sys, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self, off):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.fc, self.head = nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40)
            if off:
                with torch.no_grad():
                    self.head.weight.add_(1e-3)
        def forward(self, ids):
            return self.head(torch.tanh(self.fc(self.emb(ids).mean(1))))

    def worker(rank, port, world, off):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = LM(off).eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        world = int(sys.argv[1])
        mp.spawn(worker, args=(port, world, "off" in sys.argv), nprocs=world)
"""


def test_diff_across_world_sizes_compares_replicated_weights_by_digest(tmp_path: Path) -> None:
    """`diff` of a 1-rank run against a 2-rank run said the weights could not be compared
    ("digests are per shard") although every parameter is replicated, and never named the head
    weight whose values differ. A parameter with one digest on every rank of each run is
    compared by digest; one with the same digests is not called a difference."""
    _script(tmp_path, "rep", _REPLICATED_ON_ANY_WORLD)
    runs = {}
    for name, argv in (("w1", ["1"]), ("w2", ["2"]), ("w2off", ["2", "off"])):
        runs[name] = tmp_path / f"rec-{name}"
        p = _replay("record", "--quiet", "--out", runs[name], "--", sys.executable, "rep.py", *argv, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
    off = _replay("diff", runs["w1"], runs["w2off"], "--json", cwd=tmp_path)
    d = json.loads(off.stdout)
    weights = next(c for c in d["other_differences"] if c["category"] == "weights")
    assert [i["name"] for i in weights["items"]] == ["head.weight"], weights
    assert weights["items"][0]["why"].startswith("digest (replicated"), weights
    assert "weights differ: head.weight" in d["headline"], d["headline"]
    same = _replay("diff", runs["w1"], runs["w2"], "--json", cwd=tmp_path)
    d = json.loads(same.stdout)
    weights = next(c for c in d["other_differences"] if c["category"] == "weights")
    assert not weights["items"] and "the 5 replicated in both runs have the same digests" in weights["note"], weights


# A KV cache kept as a plain Python list on the module, grown with torch.cat: no keyframe holds it.
_LIST_CACHE = """
    import torch, torch.nn as nn

    class AttnLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.qkv, self.head = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)
            self.cache = [None, None]
        def forward(self, ids):
            x = self.emb(ids)
            q, k, v = self.qkv(x).chunk(3, -1)
            K, V = self.cache
            K = k if K is None else torch.cat([K, k], 0)
            V = v if V is None else torch.cat([V, v], 0)
            self.cache = [K, V]
            return self.head(x + torch.softmax(q @ K.T / 4.0, -1) @ V)

    torch.manual_seed(0)
    m = AttnLM()
    tok = torch.tensor([1])
    with torch.no_grad():
        for _ in range(7):
            tok = m(tok).argmax(-1)
"""


def test_a_step_at_its_own_keyframe_that_lacks_state_is_rerun_from_step_zero(tmp_path: Path) -> None:
    """`replay step` of a keyframe's own step (4, with --keyframe-every 4) said "not reproduced"
    for a deterministic program whose cache no keyframe holds, while step 5 fell back to step 0
    and reproduced, and bisect steps said every step re-ran as recorded. The keyframe's own
    step falls back to step 0 too, and says the keyframe does not hold the state."""
    _script(tmp_path, "listcache", _LIST_CACHE)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--keyframe-every", "4", "--", sys.executable, "listcache.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    p = _replay("step", out, "--step", "4", "--no-save", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert d["headline"].startswith("reproduced: rank 0 step 4 re-ran bit for bit"), d["headline"]
    assert any("re-run from its own keyframe (step 4) the step did not reproduce" in n and "does not hold all the state" in n
               for n in d["notes"]), d["notes"]


# A batch that shrinks as requests end; the step takes a dict batch with request ids and
# positions. argv "short": request 0 ends after 2 tokens instead of 4 (no request's tokens change).
_SHRINKING_BATCH = """
    import sys, torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.l1, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)
        def forward(self, batch):
            h = torch.tanh(self.l1(self.emb(batch["ids"]) + batch["input_pos"].unsqueeze(-1).float() * 0.1))
            logits = self.head(h)
            return {"logits": logits, "tokens": logits.argmax(-1)}

    torch.manual_seed(0)
    m = LM()
    reqs = [0, 1, 2]
    lengths = {0: 2 if "short" in sys.argv else 4, 1: 5, 2: 6}
    ids, pos = torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long)
    done = {r: 0 for r in reqs}
    with torch.no_grad():
        while reqs:
            o = m({"ids": ids, "input_pos": pos, "request_ids": torch.tensor(reqs)})
            keep = []
            for j, r in enumerate(reqs):
                done[r] += 1
                if done[r] < lengths[r]:
                    keep.append(j)
            reqs = [reqs[j] for j in keep]
            ids, pos = o["tokens"][keep], pos[keep] + 1
"""


def test_diff_aligns_rows_by_request_when_the_batches_first_differ_later(tmp_path: Path) -> None:
    """One request ended two steps earlier in B: the batches first differ at step 1, and diff
    said "first token divergence step 1" between batches of other requests (it aligned rows by
    request only when they differed at the first step, and missed request ids nested in a dict
    batch). Rows are aligned by request and position: none differs."""
    _script(tmp_path, "shrink", _SHRINKING_BATCH)
    runs = []
    for argv in ([], ["short"]):
        out = tmp_path / f"rec{len(runs)}"
        p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "shrink.py", *argv, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(out)
    d = json.loads(_replay("diff", *runs, "--json", cwd=tmp_path).stdout)
    assert d["first_token_divergence"] is None, d["first_token_divergence"]
    assert d["batching"] and d["batching"]["aligned"] and d["batching"]["rows_differ"] == 0, d["batching"]
    assert "by request and position, 0 of" in d["headline"], d["headline"]


@pytest.mark.smoke
def test_the_caller_advice_also_names_the_loop_remedy() -> None:
    """A global set by the loop in main(), read in forward, the step called through a thin
    run_step(m, ids): the advice was only "record the caller as the step", which re-recorded
    the same miss; the loop remedy came only after that second recording. Both come at once."""
    from replay.rerun.runner import caller_hint

    hint = caller_hint("gen:run_step")
    assert "record the caller as the step: replay record --step gen:run_step" in hint, hint
    assert "if the loop that calls gen:run_step sets it between steps instead" in hint and "as an argument" in hint, hint


_HOOK_ON_A_COMPILED_FORWARD = """
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        def forward(self, ids):
            return self.head(torch.relu(self.emb(ids)))

    torch.manual_seed(0)
    m = LM()
    m.register_forward_hook(lambda mod, inp, out: out / 0.5)  # a temperature, applied by a hook
    m.forward = torch.compile(m.forward, backend="eager")
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        for _ in range(4):
            ids = m(ids).argmax(-1)
"""


def test_hooks_after_a_compiled_forward_are_named(tmp_path: Path) -> None:
    """A forward hook (a temperature) on a module whose forward is torch.compile'd runs after
    what is recorded, as on a plain forward; only the plain forward was said to have hooks."""
    _script(tmp_path, "hooked", _HOOK_ON_A_COMPILED_FORWARD)
    p = _replay("record", "--quiet", "--out", tmp_path / "rec", "--", sys.executable, "hooked.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "has forward hooks of the program's (<lambda>)" in p.stderr, p.stderr


def test_step_of_an_intact_rank_goes_on_when_another_ranks_file_is_damaged(tmp_path: Path) -> None:
    """Rank 1's file truncated in transit: info left rank 1 out and offered `replay step --rank 0`,
    which then stopped with rank 1's error (it compares the re-run with every rank's recorded
    logits). Rank 0's step is re-run and compared with its own recording; rank 1 is named as
    not compared."""
    _script(tmp_path, "carried", _STATE_OFF_BEFORE_THE_LOOP)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", sys.executable, "carried.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    h5 = out / "run-000" / "rank-00001.h5"
    h5.write_bytes(h5.read_bytes()[: h5.stat().st_size // 2])
    p = _replay("step", out, "--rank", "0", "--step", "2", "--factory", "carried:build", "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced: rank 0 step 2"), p.stdout
    assert "rank 1's recorded logits not compared" in p.stdout and "cannot be read" in p.stdout, p.stdout
