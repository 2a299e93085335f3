"""Found in the twenty-first session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _record, _replay, _script

pytestmark = pytest.mark.e2e

# A decode loop over a plain function: with no flags nothing is found, and the summary says to
# name the step with --step.
_PLAIN_FUNCTION_STEP = """
    import torch

    def decode(w, x):
        return (x @ w).tanh()

    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(1, 8)
    for _ in range(4):
        x = decode(w, x)
    print("done", float(x.sum()))
"""


def test_recording_again_with_step_reuses_an_out_that_recorded_nothing(tmp_path) -> None:
    """``record --out rec`` of a loop with no module says "nothing was recorded ... name the step
    with --step"; doing so with the same --out was refused ("already holds a recording"). A
    recording that holds nothing is replaced; one that holds steps is still refused."""
    _script(tmp_path, "loop", _PLAIN_FUNCTION_STEP)
    out = tmp_path / "rec"
    first = _replay("record", "--out", out, "--", "python3", "loop.py", cwd=tmp_path)
    assert "--step" in first.stderr, first.stderr[-2000:]
    again = _replay("record", "--quiet", "--out", out, "--step", "loop:decode", "--", "python3", "loop.py", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    info = _replay("info", out, cwd=tmp_path)
    assert info.returncode == 0 and "4" in info.stdout, info.stdout + info.stderr
    # A recording with steps in it is never replaced.
    third = _replay("record", "--quiet", "--out", out, "--step", "loop:decode", "--", "python3", "loop.py", cwd=tmp_path)
    assert third.returncode != 0 and "already holds a recording" in third.stderr
    assert _replay("info", out, cwd=tmp_path).returncode == 0


# A model whose cache (a buffer) the prefill fills under the program's autocast setting: the
# two runs differ in that setting, and therefore in the buffer as the first recorded step saw it.
_AUTOCAST_PREFILL = """
    import os
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32)
            self.register_buffer("mem", torch.zeros(1, 16))
        def forward(self, ids):
            h = self.proj(self.emb(ids)).float()
            self.mem.copy_(0.5 * self.mem + 0.5 * h[:, -1])
            return self.head(h + self.mem[:, None])

    torch.manual_seed(0)
    model = LM().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=os.environ.get("AUTOCAST") == "1"):
        for _ in range(4):
            ids = model(ids)[:, -1:].argmax(-1)
"""


def test_diff_lists_a_setting_that_differs_before_the_buffer_it_changed(tmp_path) -> None:
    """Two runs, one under autocast: the cache the prefill filled differs at the first recorded
    step because of it. "most likely cause first" listed the buffer above the autocast flag."""
    _script(tmp_path, "lm", _AUTOCAST_PREFILL)
    outs = []
    for flag in ("0", "1"):
        out = tmp_path / f"rec-{flag}"
        env_cmd = ["env", f"AUTOCAST={flag}", "python3", "lm.py"]
        p = _replay("record", "--quiet", "--out", out, "--", *env_cmd, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(out)
    d = _replay("diff", *outs, cwd=tmp_path)
    lines = d.stdout.splitlines()
    tail = lines[next(i for i, line in enumerate(lines) if "most likely cause first" in line) + 1:]
    numerics = next(i for i, line in enumerate(tail) if line.split()[:1] == ["numerics"])
    buffers = next(i for i, line in enumerate(tail) if line.split()[:1] == ["buffers"])
    assert "autocast" in tail[numerics], d.stdout
    assert "differ" in tail[buffers] and "mem" in tail[buffers], d.stdout
    assert numerics < buffers, d.stdout


# A speculative step over two models passed as arguments: the draft (the step's object) and a
# frozen target, recorded by class name only; and a cache object the loop fills, which is not
# frozen. ``CHANGE=1`` makes the loop move the target's own step counter too.
_TWO_MODELS_AND_A_CACHE = """
    import os
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.emb = nn.Embedding(32, dim)
            self.head = nn.Linear(dim, 32)
            self.calls = 0
        def forward(self, ids):
            return self.head(self.emb(ids))

    class Cache:
        def __init__(self):
            self.tokens = []

    def spec_step(draft, target, cache, ids):
        guess = draft(ids).argmax(-1)
        if os.environ.get("CHANGE") == "1":
            target.calls += 1
        out = target(guess).argmax(-1)
        cache.tokens.append(out)
        return out

    torch.manual_seed(0)
    draft, target, cache = LM(8).eval(), LM(16).eval(), Cache()
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(4):
            ids = spec_step(draft, target, cache, ids)
"""


@pytest.mark.parametrize("change", ["0", "1"])
def test_record_warns_only_of_objects_the_program_changed(tmp_path, change) -> None:
    """``record`` warned that what the program changes in a frozen target model between steps
    is not reproduced (alarming, and untrue of it); it warns of the cache the loop fills, and of
    the target only when the loop changes it."""
    _script(tmp_path, "spec", _TWO_MODELS_AND_A_CACHE)
    p = _replay("record", "--out", tmp_path / "rec", "--step", "spec:spec_step", "--",
                "env", f"CHANGE={change}", "python3", "spec.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    warning = next((line for line in p.stderr.splitlines() if "recorded by class name only" in line), "")
    assert "cache (a Cache)" in warning, p.stderr
    assert ("target (" in warning) == (change == "1"), p.stderr


# A model quantised with torch.ao's dynamic quantisation: its Linear weights are neither
# parameters nor buffers (packed in a script object). ``BUMP=1`` changes one weight before.
_DYNAMIC_INT8 = """
    import os, warnings
    import torch, torch.nn as nn
    warnings.simplefilter("ignore")

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.l1 = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32)
        def forward(self, ids):
            return self.head(torch.relu(self.l1(self.emb(ids))))

    torch.manual_seed(0)
    model = LM().eval()
    if os.environ.get("BUMP") == "1":
        with torch.no_grad():
            model.l1.weight[3, 5] += 0.5
    model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(5):
            ids = model(ids).argmax(-1)
"""


def test_diff_compares_the_packed_weights_of_a_dynamically_quantised_model(tmp_path) -> None:
    """``diff`` said "weights the same" for two int8 models whose l1 weights differ (only the
    embedding, the one parameter left, was digested)."""
    import json

    _script(tmp_path, "q", _DYNAMIC_INT8)
    outs = []
    for bump in ("0", "1"):
        out = tmp_path / f"rec-{bump}"
        p = _replay("record", "--quiet", "--out", out, "--", "env", f"BUMP={bump}", "python3", "q.py", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(out)
    d = _replay("diff", *outs, "--json", cwd=tmp_path)
    weights = next(c for c in json.loads(d.stdout)["other_differences"] if c["category"] == "weights")
    assert [i["name"] for i in weights["items"]] == ["l1.weight"], weights


# A replicated two-rank engine (a plain class, a factory, toggles): only rank 1 is given
# ``fast_from=3``, which switches a GELU to its tanh form from its fourth step on.
_RANK_SETTING = """
    import socket
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class Model(nn.Module):
        def __init__(s):
            super().__init__()
            s.emb = nn.Embedding(40, 16); s.up = nn.Linear(16, 32); s.down = nn.Linear(32, 16); s.head = nn.Linear(16, 40)
            s.approx = "none"
        def forward(s, tok):
            x = s.emb(tok)
            return s.head(x + s.down(F.gelu(s.up(x), approximate=s.approx)))[:, -1]

    class Engine:
        def __init__(s, fast_from=None):
            torch.manual_seed(0)
            s.model = Model().eval(); s.fast_from = fast_from; s.n = 0
        def config(s):
            return {"fast_from": s.fast_from}
        def replay_toggles(s):
            return {"fast_from": [None, 3]}
        @torch.no_grad()
        def step(s, tok):
            s.model.approx = "tanh" if s.fast_from is not None and s.n >= s.fast_from else "none"
            s.n += 1
            return s.model(tok)

    def build(config, *, rank, world_size, device, options):
        cfg = dict(config); cfg.update({k: v for k, v in options.items() if k in cfg})
        return Engine(cfg["fast_from"])

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        eng = Engine(fast_from=3 if rank == 1 else None)
        tok = torch.tensor([[1]])
        for _ in range(6):
            nxt = eng.step(tok).argmax(-1, keepdim=True)
            both = [torch.empty_like(nxt) for _ in range(2)]
            dist.all_gather(both, nxt)
            tok = both[0]
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_bisect_config_builds_each_rank_from_its_own_recorded_config(tmp_path) -> None:
    """``bisect config`` between ranks said "re-run with the recorded settings it already matches
    rank 0: nothing to bisect" for a rank whose own recorded config holds the setting that made
    it differ: it built rank 1 from rank 0's recorded config. It names the setting."""
    _script(tmp_path, "eng", _RANK_SETTING)
    out = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", out, "--step", "eng:Engine.step", "--config", "config",
                "--factory", "eng:build", "--", "python3", "eng.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    b = _replay("bisect", "config", out, "--no-save", cwd=tmp_path)
    assert "nothing to bisect" not in b.stdout, b.stdout + b.stderr[-2000:]
    assert "fast_from=null" in b.stdout.splitlines()[0], b.stdout + b.stderr[-2000:]


# Two models of one architecture with other weights (an A/B check of two fine-tunes), each
# decoding in turn; with ``THREADS=1`` each in a worker thread of its own, at the same time (a
# barrier in the forward makes their steps overlap).
_TWO_OF_A_KIND = """
    import os, threading
    import torch, torch.nn as nn

    THREADS = os.environ.get("THREADS") == "1"
    barrier = threading.Barrier(2, timeout=10)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.mix = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32)
            self.register_buffer("mem", torch.zeros(1, 16))
            self.calls = 0
        def forward(self, ids):
            self.calls += 1
            if THREADS and self.calls == 3:
                barrier.wait()  # both threads inside a step at once
            h = torch.tanh(self.mix(self.emb(ids)[:, -1]) + self.mem)
            self.mem.copy_(h)
            return self.head(h)

    torch.set_num_threads(1)
    models = {}
    for name, seed in (("base", 0), ("tuned", 1)):
        torch.manual_seed(seed)
        models[name] = LM().eval()
    out = {}

    def decode(name, first):
        ids = torch.tensor([[first]])
        toks = []
        with torch.no_grad():
            for _ in range(6):
                ids = models[name](ids).argmax(-1, keepdim=True)
                toks.append(int(ids))
        out[name] = toks

    if THREADS:
        ths = [threading.Thread(target=decode, args=(n, f), name=n) for n, f in (("base", 1), ("tuned", 2))]
        for t in ths: t.start()
        for t in ths: t.join()
    else:
        decode("base", 1)
        decode("tuned", 2)
    print(sorted(out.items()))
"""


def test_a_second_model_of_the_same_architecture_is_re_run_on_its_own_weights(tmp_path) -> None:
    """Two instances of one class, one after the other: the second's steps were re-run on the
    first instance (the re-launch took the first whose parameter names and shapes matched), and
    came back "not reproduced ... the step ran with other weights than the re-run's"."""
    import json

    _script(tmp_path, "ab", _TWO_OF_A_KIND)
    out, _ = _record(tmp_path, "ab")
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    streams = {s["stream"]: s for s in info["streams"]}
    assert len(streams) == 2, info["streams"]
    second = max(streams.values(), key=lambda s: s["first_step"])
    s = _replay("step", out, "--step", second["last_step"], "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced:"), s.stdout + s.stderr[-2000:]


def test_steps_of_two_threads_at_once_are_recorded_one_thread_at_a_time(tmp_path) -> None:
    """Two worker threads, each decoding with its own model, their steps overlapping: the
    recorder ended one thread's open step when the other's began ("rank 0 raised: step did not
    end before the next began", which the program never did), or stopped itself on its record
    ring ("job 3 found where job 1 was due"). It records one thread's steps, says so, and the
    recorded steps re-run."""
    import json
    import subprocess
    import sys

    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "th", _TWO_OF_A_KIND)
    env = {**_env(), "THREADS": "1"}
    plain = subprocess.run([sys.executable, "th.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = tmp_path / "rec"
    p = subprocess.run([sys.executable, "-m", "replay", "record", "--out", str(out), "--", sys.executable, "th.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout == plain.stdout, p.stdout + p.stderr[-2000:]
    assert "recording stopped" not in p.stderr, p.stderr[-2000:]
    info = _replay("info", out, cwd=tmp_path)
    assert "steps ran in two threads at once" in info.stdout, info.stdout
    data = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    rank = data["ranks"][0]
    assert rank["raised_steps"] == 0 and rank["last_error"] is None and rank["steps"] >= 4, rank
    s = _replay("step", out, "--step", rank["steps"] - 1, "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced:"), s.stdout + s.stderr[-2000:]


def test_a_step_of_a_dynamically_quantised_model_re_runs(tmp_path) -> None:
    """The packed weights digested with the parameters are found on the re-launched program's
    model too: its step is taken and re-runs bit for bit."""
    _script(tmp_path, "q", _DYNAMIC_INT8)
    out, _ = _record(tmp_path, "q")
    s = _replay("step", out, "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced:"), s.stdout + s.stderr[-2000:]


# Two replicated ranks; rank 1 runs its steps under CPU autocast (bfloat16) from its third step,
# and with a setting that changes nothing here (cuDNN's benchmark mode) from the start.
_AUTOCAST_ON_ONE_RANK = """
    import contextlib, socket
    import torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16); self.mix = nn.Linear(16, 16); self.head = nn.Linear(16, 40)
        def forward(self, tok):
            return self.head(torch.tanh(self.mix(self.emb(tok)[:, -1]))).float()

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = rank == 1  # differs from the start, and changes nothing here
        model = LM().eval()
        tok = torch.tensor([[1]])
        with torch.no_grad():
            for i in range(6):
                fast = rank == 1 and i >= 3
                with torch.autocast("cpu", dtype=torch.bfloat16) if fast else contextlib.nullcontext():
                    logits = model(tok)
                nxt = logits.argmax(-1, keepdim=True)
                both = [torch.empty_like(nxt) for _ in range(2)]
                dist.all_gather(both, nxt)
                tok = both[0]
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_info_and_step_name_the_numerics_setting_a_diverging_rank_ran_under(tmp_path) -> None:
    """Rank 1 ran under autocast from one step on: info named the step and rank, and ``step
    --rank 1`` said "vs rank 0: different"; nothing said that rank 1's steps ran under other
    numerics settings (only ``diff`` between the ranks did). Both say so."""
    import json

    _script(tmp_path, "ac", _AUTOCAST_ON_ONE_RANK)
    out, _ = _record(tmp_path, "ac")
    info = _replay("info", out, cwd=tmp_path)
    assert "first divergence        step 2:" in info.stdout, info.stdout  # the prefill is not a step
    line = next(x for x in info.stdout.splitlines() if "under other numerics settings" in x)
    assert line.strip().startswith("rank 1 ran step 2 under other numerics settings than rank 0") and \
        "autocast.cpu.enabled True (rank 0: False), since step 2" in line, line
    # The setting that began to differ where the bits did comes before one that differed all along.
    assert line.index("autocast.cpu.enabled") < line.index("backends.cudnn.benchmark True (rank 0: False), since step 0"), line
    data = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert data["numerics_at_divergence"]["rank"] == 1 and data["numerics_at_divergence"]["step"] == 2, data
    # And the re-run of rank 1's step, against rank 0's recorded bits, says why they differ.
    s = _replay("step", out, "--rank", "1", "--step", "2", "--no-save", cwd=tmp_path)
    assert "note: rank 0 ran step 2 under other numerics settings than rank 1 when recorded: autocast.cpu.enabled: here true, rank 0 false" in s.stdout, s.stdout + s.stderr[-2000:]


# Two ranks; the model writes its logits into a buffer and returns nothing (a graph runner's
# static output), and rank 1 computes them otherwise from its fourth call.
_STATIC_OUTPUT = """
    import socket
    import torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(41, 16); self.head = nn.Linear(16, 41); self.other = False
            self.register_buffer("out", torch.zeros(1, 41))
        def forward(self, tok):
            h = torch.tanh(self.emb(tok))
            self.out.copy_(self.head(-h) if self.other else self.head(h))

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(0)
        m = LM().eval()
        tok = torch.tensor([5])
        with torch.no_grad():
            for i in range(8):
                m.other = rank == 1 and i >= 3
                m(tok)
                tok = (m.out.argmax(-1) + i) % 41
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_info_says_a_divergence_found_in_inputs_alone_may_start_earlier(tmp_path) -> None:
    """The steps record no output (they write a buffer and return nothing): the ranks' first
    difference is in a later step's input, and info named that step with no caveat (one rank
    alone said "nothing to compare ... no output")."""
    _script(tmp_path, "so", _STATIC_OUTPUT)
    out, _ = _record(tmp_path, "so")
    info = _replay("info", out, cwd=tmp_path)
    first = info.stdout.splitlines()[0]
    assert first.startswith("first divergence at step") and "no step output recorded" in first, info.stdout
    assert "no token divergence" not in info.stdout and "record a callable inside the step with --probe" in info.stdout, info.stdout


# A front end that starts its model worker as a subprocess and feeds it requests on a pipe.
_FRONTEND = """
    import json, subprocess, sys
    reqs = [{"prompt": [1, 2, 3], "n": 4}, {"prompt": [8, 9], "n": 4}]
    p = subprocess.run([sys.executable, "worker.py"], input="".join(json.dumps(r) + "\\n" for r in reqs),
                       capture_output=True, text=True)
    print(p.stdout.strip())
    sys.exit(p.returncode)
"""
_WORKER = """
    import json, sys
    import torch, torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(8, 16)).eval()
    with torch.no_grad():
        for line in sys.stdin:
            req = json.loads(line)
            tok = torch.tensor([req["prompt"][-1]])
            for _ in range(req["n"]):
                tok = model(tok).argmax(-1)
            print(int(tok))
"""


def test_a_worker_fed_on_a_pipe_by_its_parent_is_said_to_be_so_when_it_cannot_be_re_run(tmp_path) -> None:
    """The worker read its requests from a pipe its front end fed; replay keeps the command's
    stdin only, so the re-launched worker read none and never called its step. The error named
    no cause; it says where the worker's stdin came from, and what to do."""
    _script(tmp_path, "front", _FRONTEND)
    _script(tmp_path, "worker", _WORKER)
    out, _ = _record(tmp_path, "front")
    s = _replay("step", out, "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode != 0 and "reproduced" not in s.stdout, s.stdout
    last = s.stderr.strip().splitlines()[-1]
    assert "without calling the recorded step" in last and "its stdin was not the command's" in last, s.stderr[-2000:]


# A plain engine whose cache is a Python list it resets for each request: there is no tensor
# of the step's object for a keyframe to keep.
_LIST_CACHE = """
    import torch, torch.nn as nn

    torch.manual_seed(0)

    class Engine:
        def __init__(self):
            self.emb = nn.Embedding(31, 16); self.k = nn.Linear(16, 16); self.head = nn.Linear(16, 31)
            self.cache = []
        def forward_tok(self, x):
            h = self.emb(x)
            self.cache.append(self.k(h))
            return self.head(h + torch.cat(self.cache, 1).mean(1, keepdim=True))[:, -1]

    eng = Engine()
    with torch.no_grad():
        for prompt in ([1, 2, 3], [4, 5]):
            eng.cache = []
            x = torch.tensor([prompt])
            for _ in range(4):
                x = eng.forward_tok(x).argmax(-1, keepdim=True)
"""


def test_a_recording_with_no_keyframe_is_not_told_to_keyframe_every_step(tmp_path) -> None:
    """The re-run of the second request's steps departs (the engine reset its list cache); the
    hint said "a keyframe every step restores it: --keyframe-every 1", also for a recording made
    with it that holds no keyframe. It says what to name with --state."""
    _script(tmp_path, "lc", _LIST_CACHE)
    out, _ = _record(tmp_path, "lc", "--step", "lc:Engine.forward_tok", "--keyframe-every", "1")
    s = _replay("step", out, "--step", "6", "--no-save", cwd=tmp_path)
    assert s.stdout.startswith("not reproduced"), s.stdout + s.stderr[-2000:]
    assert "--keyframe-every 1" not in s.stdout and "replay record --state NAME" in s.stdout, s.stdout


# An engine that is a plain class holding torch layers, its step a method.
_PLAIN_ENGINE = """
    import torch, torch.nn as nn

    torch.manual_seed(0)

    class Engine:
        def __init__(self):
            self.emb = nn.Embedding(31, 16); self.mix = nn.Linear(16, 16); self.head = nn.Linear(16, 31)
        def forward_tok(self, x):
            return self.head(torch.tanh(self.mix(self.emb(x))))[:, -1]

    eng = Engine()
    x = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(5):
            x = eng.forward_tok(x).argmax(-1, keepdim=True)
"""


def test_a_plain_engine_is_told_to_name_its_step_method_not_torch_s_layers(tmp_path) -> None:
    """With no flags the outermost module of a plain-class engine is torch's Embedding; the
    summary suggested recording torch's Embedding and Linear too (ten streams of torch layers).
    It names the engine's method that called them."""
    _script(tmp_path, "pe", _PLAIN_ENGINE)
    p = _replay("record", "--out", tmp_path / "rec", "--", "python3", "pe.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "replay record --step pe:Engine.forward_tok" in p.stderr, p.stderr
    assert "--step torch.nn.modules.linear:Linear" not in p.stderr, p.stderr


# A decode loop over a torch.jit.trace'd module (torch.jit.trace runs the module to check it).
_TRACED_STEP = """
    import torch, torch.nn as nn

    torch.manual_seed(0)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(31, 16); self.head = nn.Linear(16, 31)
        def forward(self, tok):
            return self.head(self.emb(tok))

    traced = torch.jit.trace(Step().eval(), (torch.tensor([1]),))
    tok = torch.tensor([1])
    with torch.no_grad():
        for _ in range(5):
            tok = traced(tok).argmax(-1)
"""


def test_a_module_torch_jit_trace_ran_is_neither_chosen_nor_offered(tmp_path) -> None:
    """With no flags, the module was chosen at the call ``torch.jit.trace`` made to check its
    trace ("chosen at its first call but never ran again"), then offered as a --step candidate
    that would record nothing. Only the TorchScript module the loop calls is named, with why."""
    _script(tmp_path, "tr", _TRACED_STEP)
    p = _replay("record", "--out", tmp_path / "rec", "--", "python3", "tr.py", cwd=tmp_path)
    assert "tr:Step" not in p.stderr and "never ran again" not in p.stderr, p.stderr
    assert "TopLevelTracedModule is TorchScript" in p.stderr, p.stderr


# Two replicated ranks whose model takes its sampling temperature as a Python float; rank 1
# passes another one from its fourth call.
_TEMPERATURE_ON_ONE_RANK = """
    import socket
    import torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16); self.head = nn.Linear(16, 40)
        def forward(self, tok, temperature):
            return self.head(torch.tanh(self.emb(tok)[:, -1])) / temperature

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = LM().eval()
        tok = torch.tensor([[1]])
        with torch.no_grad():
            for i in range(6):
                logits = model(tok, 0.7 if rank == 1 and i >= 3 else 0.8)
                nxt = logits.argmax(-1, keepdim=True)
                both = [torch.empty_like(nxt) for _ in range(2)]
                dist.all_gather(both, nxt)
                tok = both[0]
        dist.destroy_process_group()
""" + _SPAWN_TWO_RANKS


def test_info_names_a_plain_argument_a_diverging_rank_passed_otherwise(tmp_path) -> None:
    """Rank 1 passed another temperature (a Python float) from one step on: the recording holds
    both values, and info, diff and step said only that the logits differ. info names it."""
    import json

    _script(tmp_path, "temp", _TEMPERATURE_ON_ONE_RANK)
    out, _ = _record(tmp_path, "temp")
    info = _replay("info", out, cwd=tmp_path)
    assert "first divergence        step 2:" in info.stdout, info.stdout
    assert "rank 1 called step 2 with other arguments than rank 0, the newest first: temperature 0.7 (rank 0: 0.8), since step 2" \
        in info.stdout, info.stdout
    data = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert data["arguments_at_divergence"]["changes"][0]["name"] == "temperature", data
