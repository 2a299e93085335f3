"""Found in the twenty-second session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _record, _replay, _script

pytestmark = pytest.mark.e2e


# A model one of whose layers the loop wraps in an adapter at its fifth call (replay's step 3:
# the first call is the prefill, found with no flags and not recorded).
_ADAPTER_MID_RUN = """
    import torch, torch.nn as nn

    class LoRA(nn.Module):
        def __init__(self, base, r=2):
            super().__init__()
            self.base = base
            g = torch.Generator().manual_seed(5)
            self.A = nn.Parameter(torch.randn(r, base.in_features, generator=g) * 0.1)
            self.B = nn.Parameter(torch.randn(base.out_features, r, generator=g) * 0.1)
        def forward(self, x):
            return self.base(x) + x @ self.A.t() @ self.B.t()

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.l1 = nn.Linear(16, 16)
            self.l2 = nn.Linear(16, 16)
            self.head = nn.Linear(16, 40)
        def forward(self, ids):
            return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids).mean(1))))))

    torch.manual_seed(0)
    m = LM()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for i in range(8):
            if i == 4:
                m.l2 = LoRA(m.l2)
            nxt = m(ids).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    print("tokens", ids.tolist())
"""


def test_a_model_whose_parameters_changed_while_recorded_is_named_and_no_keyframe_is_offered(tmp_path) -> None:
    """A loop that wrapped a layer of its model in an adapter mid-run: a re-run builds the model
    as at its first recorded step, so steps after the change did not reproduce, and `replay step`
    told the user to record with --keyframe-every 1, which restores nothing of the kind. `info`
    now names the change, and `step` says why no keyframe helps; steps before it still reproduce."""
    _script(tmp_path, "lora", _ADAPTER_MID_RUN)
    out, _ = _record(tmp_path, "lora")
    info = _replay("info", out, cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "changed its parameters after its first recorded step" in info.stdout, info.stdout
    assert "4 added (l2.A, l2.B, l2.base.weight, l2.base.bias), 2 removed (l2.weight, l2.bias)" in info.stdout, info.stdout
    after = _replay("step", out, "--step", "5", "--json", cwd=tmp_path)
    text = _replay("step", out, "--step", "5", cwd=tmp_path).stdout
    assert text.startswith("not reproduced"), text
    assert "changed its parameters after its first recorded step" in text.splitlines()[0], text
    assert "--keyframe-every 1" not in text, text
    result = json.loads(after.stdout)
    assert result["headline"].startswith("not reproduced") and "l2.A" in (result.get("parameters_changed") or ""), result
    before = _replay("step", out, "--step", "1", cwd=tmp_path)
    assert before.returncode == 0 and before.stdout.startswith("reproduced"), before.stdout + before.stderr


# Two gloo ranks (mp.spawn), each decoding on its own; rank 1's forward raises at its sixth call
# (replay's step 4: the first call is the prefill), after rank 0 has finished.
_ONE_RANK_RAISES = """
    import socket, time, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self, rank):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)
            self.rank, self.calls = rank, 0
        def forward(self, ids):
            self.calls += 1
            if self.rank == 1 and self.calls == 6:
                time.sleep(1.0)  # rank 0 is done by then
                raise ValueError("rank 1: bad block table")
            return self.head(self.emb(ids).mean(1))

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM(rank)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(8):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_a_rank_that_raised_in_a_step_another_completed_is_the_first_divergence(tmp_path) -> None:
    """Rank 1 raised in step 4, which rank 0 completed: info, report and bisect steps said "no
    divergence" (a raised step records no output, and fields were compared only where both ranks
    had them). That step is the first divergence, said as such."""
    _script(tmp_path, "raises", _ONE_RANK_RAISES)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", "python3", "raises.py", cwd=tmp_path)
    assert rec.returncode != 0, rec.stderr[-2000:]  # the program's own failure, as without replay
    info = _replay("info", out, "--json", cwd=tmp_path)
    d = json.loads(info.stdout)["first_divergence"]
    assert d is not None and d["step"] == 4 and d["ranks"] == [1], d
    text = _replay("info", out, cwd=tmp_path).stdout
    assert text.startswith("first divergence at step 4: rank(s) 1 raised in the step, rank(s) 0 completed it"), text
    bisect = _replay("bisect", "steps", out, "--no-save", cwd=tmp_path)
    assert "first disagree at step 4" in bisect.stdout, bisect.stdout + bisect.stderr
    report = _replay("report", out, cwd=tmp_path)
    assert report.stdout.startswith("first divergence at step 4"), report.stdout


# Two gloo ranks decoding the same tokens; rank 0 alone makes a health-check call of the model
# first, so its recorded steps are rank 1's one call later.
_WARM_UP_ON_ONE_RANK = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)
        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM()
        with torch.no_grad():
            if rank == 0:
                model(torch.tensor([[0]]))  # health check
            ids = torch.tensor([[1, 2, 3]])
            for _ in range(7):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        print("rank", rank, ids.tolist(), flush=True)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_ranks_offset_by_a_call_are_said_to_be_offset_not_diverged(tmp_path) -> None:
    """Rank 0 alone made one more call of the step before the loop: both ranks decode the same
    tokens, but every recorded step number is shifted, and info sent the user after a rank-1
    divergence at step 0 ("argmax agrees on 0.0%"). It now says the steps are the same steps
    offset by one call, and which step of one is which of the other."""
    _script(tmp_path, "warm", _WARM_UP_ON_ONE_RANK)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", "python3", "warm.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    s = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert s["offset_at_divergence"] == {"rank": 1, "against": 0, "shift": 1, "from": 0, "steps": 6}, s["offset_at_divergence"]
    text = _replay("info", out, cwd=tmp_path).stdout
    assert "offset by 1 call of the step" in text.splitlines()[0], text
    assert "compare rank 1's step N with rank 0's step N+1" in text, text


# Two gloo ranks that start from other random weights and take rank 0's by broadcast, as a
# DDP-style set-up does; then each decodes the same tokens.
_WEIGHTS_BROADCAST_AT_START = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)
        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(100 + rank)
        model = LM()
        for p in model.parameters():
            dist.broadcast(p.data, 0)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(6):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_a_rank_re_launched_alone_gets_the_weights_its_start_up_received(tmp_path) -> None:
    """Rank 1 takes its weights from rank 0 by broadcast at start-up. Re-launched alone, its
    start-up ran on a process group that communicates nothing, so it kept its own random weights
    and `step` said "not reproduced ... other weights". The start-up's collectives are answered
    from the recording, in order, until the step is taken over."""
    _script(tmp_path, "bcast", _WEIGHTS_BROADCAST_AT_START)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", "python3", "bcast.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    s = _replay("step", out, "--rank", "1", "--step", "3", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced: rank 1 step 3 re-ran bit for bit"), s.stdout + s.stderr[-2000:]
    assert "the re-run answered them from the recording" in s.stdout, s.stdout


# A model whose forward fails once, at its sixth call, on a module-level counter (a transient
# allocation error); the loop catches it and calls again. Keyframes every 3 steps hold the
# model's buffers, not the counter.
_FLAKY_ONCE = """
    import torch, torch.nn as nn

    CALLS = 0

    class Flaky(RuntimeError):
        pass

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(40, 16), nn.Linear(16, 40)
            self.register_buffer("pos", torch.zeros(1))
        def forward(self, ids):
            global CALLS
            CALLS += 1
            if CALLS == 6:
                raise Flaky("transient: KV block allocation failed, retry")
            self.pos += 1
            return self.head(self.emb(ids).mean(1))

    model = LM()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(8):
            try:
                logits = model(ids)
            except Flaky:
                logits = model(ids)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
"""


def test_a_step_that_completes_where_it_raised_when_recorded_is_not_reproduced(tmp_path) -> None:
    """From its keyframe, a step that raised when recorded (on a module global no keyframe holds)
    completed in the re-run: `step` said "not compared ... the recording has no output of those
    names" (exit 7), a wrong reason. It did not follow the recording: not reproduced, and why."""
    _script(tmp_path, "flaky", _FLAKY_ONCE)
    out, _ = _record(tmp_path, "flaky", "--keyframe-every", "3")
    s = _replay("step", out, "--step", "4", "--no-save", cwd=tmp_path)
    first = s.stdout.splitlines()[0] if s.stdout else ""
    assert first.startswith("not reproduced: rank 0 step 4"), s.stdout + s.stderr[-2000:]
    assert "it completed in the re-run, but raised Flaky" in first, first
    assert "no output of those names" not in s.stdout, s.stdout
    # No output of it was recorded to compare: a script reading the exit code must not take it
    # for a compared step (trial 15).
    assert s.returncode == 7 and "no output of it was recorded to compare" in s.stderr, s.stderr[-1500:]


def test_a_repeat_that_raised_is_not_called_bits_that_vary(tmp_path) -> None:
    """`--repeat 3` where a repeat raised (the module counter reached its failing call) said
    "repeats: bits vary ... a nondeterministic kernel". The repeats are not compared, and why."""
    _script(tmp_path, "flaky", _FLAKY_ONCE)
    out, _ = _record(tmp_path, "flaky")
    s = _replay("step", out, "--step", "3", "--repeat", "3", "--json", "--no-save", cwd=tmp_path)
    result = json.loads(s.stdout)
    assert result["modes"]["eager"]["repeats_equal"] is None, result["modes"]["eager"]
    assert any(n.startswith("--repeat not compared: repeat 2 raised Flaky") for n in result["notes"]), result["notes"]
    text = _replay("step", out, "--step", "3", "--repeat", "3", "--no-save", cwd=tmp_path).stdout
    assert "bits vary" not in text, text


# Two gloo ranks; rank 1 forgot model.eval(): its dropout is active in every step.
_TRAINING_MODE_ON_ONE_RANK = """
    import socket, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.drop, self.head = nn.Embedding(40, 16), nn.Dropout(0.3), nn.Linear(16, 40)
        def forward(self, ids):
            return self.head(self.drop(self.emb(ids).mean(1)))

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM()
        if rank == 0:
            model.eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(5):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_info_names_a_rank_whose_model_was_left_in_training_mode(tmp_path) -> None:
    """Rank 1 forgot .eval(): dropout made every step differ, and info named input.ids at step 0
    with no cause. It names the modes the ranks' models were in at their first recorded step."""
    _script(tmp_path, "train", _TRAINING_MODE_ON_ONE_RANK)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", "python3", "train.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    s = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert s["training_modes"] == {"0": 0, "1": 4}, s["training_modes"]
    text = _replay("info", out, cwd=tmp_path).stdout
    assert "modules in training mode: rank 0: 0, rank 1: 4" in text and "a missing .eval()?" in text, text
