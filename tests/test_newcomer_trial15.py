"""Found in the twenty-third session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _replay, _script

pytestmark = pytest.mark.e2e


def _record_with_env(tmp_path: Path, out: Path, script: str, **env: str):  # noqa: ANN202
    """``replay record --quiet`` of a script, with environment variables set for it."""
    import subprocess

    from tests.test_newcomer_scripts import _env

    return subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(out), "--", sys.executable, script],
                          cwd=tmp_path, env={**_env(), **env}, capture_output=True, text=True, timeout=300)

# A model whose output depends on a Python attribute read inside forward (a scale, a
# temperature, a flag), set from the command line; it has no config object.
_ATTRIBUTE_IN_FORWARD = """
    import sys
    import torch, torch.nn as nn

    class Model(nn.Module):
        def __init__(s, scale):
            super().__init__()
            s.emb = nn.Embedding(50, 16)
            s.fc = nn.Linear(16, 16)
            s.head = nn.Linear(16, 50)
            s.scale = scale
        def forward(s, ids):
            return s.head(torch.tanh(s.fc(s.emb(ids))) * s.scale)[:, -1]

    torch.manual_seed(0)
    model = Model(float(sys.argv[1])).eval()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
"""


def test_diff_names_a_python_attribute_of_the_model_that_differs(tmp_path: Path) -> None:
    """Two runs whose model differs only in a Python attribute read inside forward: diff said
    "config the same" (an empty config compared with an empty config) and named nothing else
    but the command line. It names the attribute, as the keyframes hold it."""
    _script(tmp_path, "attr", _ATTRIBUTE_IN_FORWARD)
    recs = []
    for scale in ("1.0", "1.001"):
        out = tmp_path / f"rec-{scale}"
        p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "attr.py", scale, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        recs.append(out)
    d = _replay("diff", *recs, cwd=tmp_path)
    assert d.returncode == 1
    config = next(line for line in d.stdout.splitlines() if line.strip().startswith("config"))
    assert "1 differ: target.scale: A 1.0, B 1.001" in config, d.stdout
    same = json.loads(_replay("diff", recs[0], recs[0], "--json", cwd=tmp_path).stdout)
    config = next(c for c in same["other_differences"] if c["category"] == "config")
    assert config["compared"] and not config["differs"], config


# Three requests decoded by concurrent tasks on one event loop, each awaiting the async step.
_CONCURRENT_ASYNC_STEPS = """
    import asyncio
    import torch, torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)).eval()

    async def step(ids):
        await asyncio.sleep(0)
        with torch.no_grad():
            logits = model(ids)[:, -1]
        await asyncio.sleep(0.001)
        return logits.argmax(-1, keepdim=True)

    async def request(first):
        ids = torch.tensor([[first]])
        for _ in range(5):
            ids = torch.cat([ids, await step(ids)], 1)

    async def main():
        await asyncio.gather(request(1), request(2), request(3))

    asyncio.run(main())
"""


def test_calls_of_an_async_step_not_recorded_while_another_is_awaited_are_said(tmp_path: Path) -> None:
    """15 calls of an async step from three concurrent tasks: 5 were recorded (one at a time),
    and neither ``replay record`` nor ``info`` said that 10 were not."""
    _script(tmp_path, "aio", _CONCURRENT_ASYNC_STEPS)
    out = tmp_path / "rec"
    p = _replay("record", "--out", out, "--step", "aio:step", "--", sys.executable, "aio.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "aio:step: 10 call(s) not recorded: each began while another call of it was being awaited" in p.stderr, p.stderr
    info = _replay("info", out, cwd=tmp_path)
    assert "5 " in info.stdout and "calls not recorded: 10 call(s) of aio:step on rank 0" in info.stdout, info.stdout
    # The step awaits a timer: a re-run inside the program's event loop refuses it, with what to
    # record instead (trial 21: the refusal offered nothing).
    s = _replay("step", out, "--rank", "0", "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode == 7 and "cannot wait for; record a step that does not await" in s.stderr, s.stdout + s.stderr


# Continuous batching: requests finish one by one, and the last decode calls run on an empty
# batch (0 rows, logits of shape (0, vocab)).
_EMPTY_BATCH = """
    import torch, torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20)).eval()
    ids, remaining = torch.tensor([1, 2, 3]), torch.tensor([3, 5, 7])
    with torch.no_grad():
        for _ in range(10):
            nxt = model(ids).argmax(-1)
            remaining = remaining - 1
            keep = remaining > 0
            ids, remaining = nxt[keep], remaining[keep]
"""


def test_a_step_on_an_empty_batch_is_recorded_and_recording_goes_on(tmp_path: Path) -> None:
    """The first step with no rows stopped the recorder ("min(): Expected reduction dim ..." from
    the logits' top-2 margin): the program went on, its later steps unrecorded. Every call is a
    step; the empty ones re-run and compare."""
    _script(tmp_path, "empty", _EMPTY_BATCH)
    out = tmp_path / "rec"
    p = _replay("record", "--out", out, "--", sys.executable, "empty.py", cwd=tmp_path)
    assert p.returncode == 0 and "recording stopped" not in p.stderr, p.stderr[-2000:]
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert [r["steps"] for r in info["ranks"]] == [9], info["ranks"]  # 10 calls, the first revealed the step
    s = _replay("step", out, "--rank", "0", "--step", "8", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and "reproduced" in s.stdout and "bit for bit" in s.stdout, s.stdout + s.stderr[-1500:]


def test_the_margin_of_no_row_is_none_rather_than_an_error() -> None:
    import math

    import numpy as np

    from replay.format.ring_salvage import margin_of

    assert math.isnan(margin_of(np.zeros((0, 20), dtype=np.float32)))
    assert math.isnan(margin_of(np.zeros((4, 1), dtype=np.float32)))
    assert margin_of(np.array([[1.0, 3.0, 2.0]], dtype=np.float32)) == 1.0


def test_a_one_step_difference_in_a_repeating_decode_is_not_called_an_offset(tmp_path: Path) -> None:
    """Rank 1 differed at step 5 only, and greedy decoding then repeated one token on every rank:
    the steps after it agree as numbered, and also shifted by one (each step the same as the
    next). info said "offset by 1 call of the step ... compare rank 1's step N with rank 0's step
    N+1" where no rank made an extra call; the steps agree as numbered, so no offset is said."""
    import torch

    from replay import Recorder, RecorderConfig

    out = tmp_path / "rec"
    for rank in range(2):
        rec = Recorder(RecorderConfig(out=out, rank=rank, world_size=2))
        rec.set_target({"factory": "tests.toy:build", "config": {}})
        for s in range(9):
            rec.begin_step()
            rec.record_inputs(ids=torch.tensor([min(s, 6)]))
            logits = torch.arange(8.0).reshape(1, 8) * (1 + min(s, 6))  # from step 6 on: the same every step
            if rank == 1 and s == 5:
                logits = logits + 1e-3
            rec.record_outputs(logits=logits)
            rec.end_step()
        rec.close()
        assert rec.error is None, rec.error
    s = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert s["first_divergence"]["step"] == 5 and s.get("offset_at_divergence") is None, s.get("offset_at_divergence")
    text = _replay("info", out, cwd=tmp_path).stdout
    assert "offset" not in text, text


# A step that reads Python's and NumPy's global generators (noise added to the logits).
_HOST_RANDOM_IN_THE_STEP = """
    import random
    import numpy as np
    import torch, torch.nn as nn

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16), nn.Linear(16, 30)).eval()

    def decode(ids):
        logits = model(ids)[:, -1]
        return logits + random.random() * 1e-3 + float(np.random.rand()) * 1e-3

    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, decode(ids).argmax(-1, keepdim=True)], 1)
"""


def test_repeats_of_a_step_that_reads_python_s_random_start_from_its_state(tmp_path: Path) -> None:
    """The first run reproduced bit for bit (the generators restored from the keyframe, caught
    up); its repeats went on from where it left them, and --repeat blamed "a nondeterministic
    kernel, or ... an unseeded random source". Each repeat starts from the same generators."""
    _script(tmp_path, "hostrng", _HOST_RANDOM_IN_THE_STEP)
    out = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", out, "--step", "hostrng:decode", "--", sys.executable, "hostrng.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", out, "--rank", "0", "--step", "3", "--repeat", "3", "--no-save", "--json", cwd=tmp_path)
    assert s.returncode == 0, s.stderr[-2000:]
    mode = json.loads(s.stdout)["modes"]["eager"]
    assert mode["repeats_equal"] is True, mode


def test_step_compares_offset_ranks_logits_at_the_step_that_holds_them(tmp_path: Path) -> None:
    """Rank 0 made one call more than rank 1 before the loop: info says rank 1's step N is rank
    0's step N+1, but `step` compared the re-run's logits with rank 0's step N ("different,
    40/40 elements differ"), a cross-rank difference that is not there."""
    from tests.test_newcomer_trial14 import _WARM_UP_ON_ONE_RANK

    _script(tmp_path, "warm", _WARM_UP_ON_ONE_RANK)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", sys.executable, "warm.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    s = _replay("step", out, "--rank", "1", "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode == 0, s.stderr[-2000:]
    assert "vs rank 0 recorded logits of its step 3: bitwise equal" in s.stdout, s.stdout
    assert "the same logits are its step 3 (the ranks are offset by 1 call(s)" in s.stdout, s.stdout


# Two gloo ranks decode the same tokens; rank 1's forward raises once (a simulated OOM) at its
# third call and the loop retries the step.
_RETRIED_ON_ONE_RANK = """
    import socket, torch, torch.nn as nn
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
            if self.rank == 1 and self.calls == 3:
                raise RuntimeError("CUDA out of memory (simulated)")
            logits = self.head(self.emb(ids).mean(1))
            return {"logits": logits, "tokens": logits.argmax(-1, keepdim=True)}

    def worker(rank, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM(rank)
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(8):
                try:
                    out = model(ids)
                except RuntimeError:
                    out = model(ids)
                ids = torch.cat([ids, out["tokens"]], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS


def test_a_rank_that_raised_and_retried_has_no_token_divergence(tmp_path: Path) -> None:
    """Rank 1 raised in a step and called it again; the ranks sampled the same tokens. info said
    "first token divergence at step 2" (the step rank 1 raised in, which sampled no token), and,
    once that was fixed, at a later step compared as numbered across the offset."""
    _script(tmp_path, "retry", _RETRIED_ON_ONE_RANK)
    out = tmp_path / "rec"
    rec = _replay("record", "--quiet", "--out", out, "--", sys.executable, "retry.py", cwd=tmp_path)
    assert rec.returncode == 0, rec.stderr[-2000:]
    s = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert s["first_divergence"]["field"] == "step status (raised)" and s["offset_at_divergence"]["shift"] == -1, s
    assert s["first_token_divergence"] is None, s["first_token_divergence"]
    head = _replay("info", out, cwd=tmp_path).stdout.splitlines()[0]
    assert head.endswith("no token divergence once the offset is taken into account"), head


# Two models of one class (a draft and a target), their weights seeded from the environment.
_TWO_MODELS_SEEDED_FROM_THE_ENVIRONMENT = """
    import os
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(30, 16), nn.Linear(16, 30)
        def forward(self, ids):
            return self.head(self.emb(ids))[:, -1]

    seed = int(os.environ.get("SEED", "0"))
    torch.manual_seed(seed)
    draft = LM().eval()
    torch.manual_seed(seed + 100)
    target = LM().eval()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, draft(ids).argmax(-1, keepdim=True)], 1)
            ids = torch.cat([ids, target(ids).argmax(-1, keepdim=True)], 1)
"""


def test_a_relaunch_that_built_other_weights_says_so_not_other_shapes(tmp_path: Path) -> None:
    """The re-launched program built both models with other weights (another seed): the refusal
    said their parameters' "names and shapes" were not the recorded ones, sending the user after
    an architecture change; it says the names and shapes are the recorded ones, the values not."""
    import subprocess

    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "seeded", _TWO_MODELS_SEEDED_FROM_THE_ENVIRONMENT)
    out = tmp_path / "rec"

    def replay(*args: object, seed: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=tmp_path, env={**_env(), "SEED": seed},
                              capture_output=True, text=True, timeout=300)

    assert replay("record", "--quiet", "--out", out, "--", sys.executable, "seeded.py", seed="1").returncode == 0
    ok = replay("step", out, "--rank", "0", "--step", "1", "--no-save", seed="1")
    assert ok.returncode == 0 and "reproduced" in ok.stdout, ok.stdout + ok.stderr[-1500:]
    other = replay("step", out, "--rank", "0", "--step", "1", "--no-save", seed="2")
    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode != 0 and "with the recorded parameter names and shapes but other values" in last, last
    assert "(names and shapes) are not" not in last


def _step_in_thread() -> str | None:
    from replay.record.tracebacks import program_caller

    return program_caller(str, f"{__name__}:_step_in_thread")


def _calls_the_step() -> str | None:
    return _step_in_thread()


def test_the_caller_offered_as_the_step_is_never_python_s_own_library() -> None:
    """A step run by a thread pool: "record the caller as the step: replay record --step
    concurrent.futures.thread:_WorkItem.run", which recorded the pool's work items (one part
    each, nothing to compare). The program's own caller is offered, or none."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(_step_in_thread).result() is None
        assert pool.submit(_calls_the_step).result() == f"{__name__}:_calls_the_step"


# vLLM-style: a runner sets the batch's block table and slots in a module-level forward context,
# then calls the model, whose forward reads them.
_FORWARD_CONTEXT_SET_BY_THE_CALLER = """
    import torch, torch.nn as nn

    torch.manual_seed(0)
    D, V, BS = 16, 24, 4

    class Ctx:
        pass

    CTX = Ctx()

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.kv, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
            self.register_buffer("pool", torch.zeros(8 * BS, D))
        def forward(self, input_ids):
            self.pool.index_copy_(0, CTX.slot, self.kv(self.emb(input_ids)))
            slots = (CTX.block_table[:, None] * BS + torch.arange(BS)).view(-1)[: CTX.length]
            return self.head(self.pool[slots].mean(0, keepdim=True))

    class ModelRunner:
        def __init__(self):
            self.model = LM().eval()
        def execute_model(self, ids, block_table, slot, length):
            CTX.block_table, CTX.slot, CTX.length = block_table, slot, length
            return self.model(ids)

    runner, table, tok = ModelRunner(), torch.tensor([5, 2, 7]), torch.tensor([3])
    with torch.no_grad():
        for pos in range(8):
            slot = (table[pos // BS] * BS + pos % BS).view(1)
            tok = runner.execute_model(tok, table, slot, pos + 1).argmax(-1)
"""


def test_a_departed_catch_up_offers_the_caller_with_the_keyframe_advice(tmp_path: Path) -> None:
    """A model that reads what its runner set up: the re-run departed in catch-up, and the only
    advice was --keyframe-every 1 (which cannot help); the advice that does (record the runner's
    method as the step) came only after re-recording with it. Both are offered at once."""
    _script(tmp_path, "paged", _FORWARD_CONTEXT_SET_BY_THE_CALLER)
    out = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "paged.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", out, "--rank", "0", "--step", "5", "--no-save", cwd=tmp_path)
    departed = next((line for line in s.stdout.splitlines() if "departed from the recording" in line), "")
    assert "--keyframe-every 1" in departed and "replay record --step paged:ModelRunner.execute_model" in departed, s.stdout


# A step that returns Python values: the sampled token (``.item()``) and its top-3 probabilities.
_PYTHON_VALUES_RETURNED = """
    import torch, torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(24, 16), nn.Linear(16, 24)).eval()

    def decode_step(tok: int):
        p = model(torch.tensor([tok])).softmax(-1)[0]
        return int(p.argmax().item()), [float(x) for x in p.topk(3).values]

    tok = 3
    with torch.no_grad():
        for _ in range(6):
            tok, top = decode_step(tok)
"""


def test_python_values_a_step_returns_beside_each_other_are_compared(tmp_path: Path) -> None:
    """``return tok.item(), top_probs``: nothing was recorded ("the step returned no tensor the
    recorder could record"), so no step could be compared. The numbers are outputs, compared."""
    _script(tmp_path, "pyvals", _PYTHON_VALUES_RETURNED)
    out = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", out, "--step", "pyvals:decode_step", "--", sys.executable, "pyvals.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", out, "--rank", "0", "--step", "3", "--no-save", "--json", cwd=tmp_path)
    assert s.returncode == 0, s.stdout + s.stderr[-1500:]
    vs = json.loads(s.stdout)["modes"]["eager"]["vs_recording"]
    assert sorted(vs) == ["out0", "out1"] and all(c["verdict"] == "bitwise equal" for c in vs.values()), vs


# The loop in main() sets a module-level value the model's forward reads.
_GLOBAL_SET_BY_THE_LOOP = """
    import torch, torch.nn as nn

    torch.manual_seed(0)
    CTX = {}

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(24, 16), nn.Linear(16, 24)
        def forward(self, ids):
            return self.head(self.emb(ids) * CTX["scale"])

    def main():
        model, tok = LM().eval(), torch.tensor([3])
        with torch.no_grad():
            for pos in range(8):
                CTX["scale"] = 1.0 + pos * 0.1
                tok = model(tok).argmax(-1)

    if __name__ == "__main__":
        main()
"""


def test_the_function_that_runs_the_loop_is_not_offered_as_the_step(tmp_path: Path) -> None:
    """The model read a global its loop set between steps: the advice was "record the caller as
    the step: replay record --step loopy:main", which records the whole run as one step. main
    runs the loop (the same frame called every step): the advice says what does help."""
    _script(tmp_path, "loopy", _GLOBAL_SET_BY_THE_LOOP)
    out = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "loopy.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", out, "--rank", "0", "--step", "4", "--no-save", cwd=tmp_path)
    departed = next((line for line in s.stdout.splitlines() if "departed from the recording" in line), "")
    assert "--step loopy:main" not in departed and "what the loop in loopy:main sets between steps" in departed, s.stdout


# A step that raised once when recorded (a fault injected by an environment variable), the
# loop going on past it.
_RAISED_WHEN_RECORDED = """
    import os
    import torch, torch.nn as nn

    torch.manual_seed(0)
    FAIL = os.environ.get("FAIL_AT")

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(24, 16), nn.Linear(16, 24)
            self.calls = 0
        def forward(self, ids):
            self.calls += 1
            if FAIL is not None and self.calls == int(FAIL):
                raise RuntimeError("injected fault")
            return self.head(self.emb(ids))

    model, tok = LM().eval(), torch.tensor([3])
    with torch.no_grad():
        for _ in range(7):
            try:
                tok = model(tok).argmax(-1)
            except RuntimeError:
                pass
"""


def test_bisect_steps_by_relaunch_finds_a_step_that_completes_where_it_raised(tmp_path: Path) -> None:
    """The last step raised when recorded and completes in the re-run: `step` said so, but bisect
    steps --against-rerun with no factory said "no departure from the recording found (every
    keyframe interval re-ran as recorded)" and exited 0."""
    _script(tmp_path, "fault", _RAISED_WHEN_RECORDED)
    out = tmp_path / "rec"
    p = _record_with_env(tmp_path, out, "fault.py", FAIL_AT="7")
    assert p.returncode == 0, p.stderr[-2000:]
    b = _replay("bisect", "steps", out, "--against-rerun", "--rank", "0", "--no-save", "--json", cwd=tmp_path)
    found = json.loads(b.stdout)  # the last call (step 5) raised when recorded: the last step scanned
    assert (found["step"], found["field"]) == (5, "status (completed; it raised when recorded)"), b.stdout


# A model whose forward reads an environment variable, and a factory that builds it.
_ENVIRONMENT_READ_IN_FORWARD = """
    import os
    import torch, torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(24, 16), nn.Linear(16, 24)
        def forward(self, ids):
            h = self.emb(ids)
            if os.environ.get("SCALE_H"):
                h = h * 1.001
            return self.head(h)

    def build(config, *, rank, world_size, device, options):
        return LM().eval()

    if __name__ == "__main__":
        model, tok = LM().eval(), torch.tensor([3])
        with torch.no_grad():
            for _ in range(6):
                tok = model(tok).argmax(-1)
"""


def test_a_factory_re_run_names_the_environment_variable_that_differs(tmp_path: Path) -> None:
    """Recorded with SCALE_H set, re-run with --factory without it: the re-launched program's
    verdict named the variable, the factory's (run in replay's process) never did, and sent the
    user to --keyframe-every 1."""
    _script(tmp_path, "envy", _ENVIRONMENT_READ_IN_FORWARD)
    out = tmp_path / "rec"
    p = _record_with_env(tmp_path, out, "envy.py", SCALE_H="1")
    assert p.returncode == 0, p.stderr[-2000:]
    s = _replay("step", out, "--rank", "0", "--step", "3", "--factory", "envy:build", "--no-save", cwd=tmp_path)
    head = s.stdout.splitlines()[0] if s.stdout else ""
    assert head.startswith("not reproduced") and "environment differs from the recorded one in SCALE_H (not set here)" in head, (
        s.stdout + s.stderr[-1500:])


def test_a_record_interrupted_before_any_model_ran_does_not_ask_to_name_the_step(tmp_path: Path) -> None:
    """Ctrl-C while the ranks were still starting: "no step found ... name the step with --step",
    advice for a run that finished without a model; this one never got there."""
    import signal
    import subprocess
    import time

    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "slow", "import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-m", "replay", "record", "--out", str(tmp_path / "rec"), "--", sys.executable, "slow.py"],
                         cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the program is running (its start-up, the recorder's bootstrap, is done)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "name the step with --step" not in err and "no step ran before the command was interrupted or killed" in err, err


# One gloo rank whose step raises inside a collective it calls (a bad reduce op, at its third call).
_RAISES_INSIDE_A_COLLECTIVE = """
    import os, socket, torch, torch.nn as nn, torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(24, 16), nn.Linear(16, 24)
            self.calls = 0
        def forward(self, ids):
            self.calls += 1
            h = self.emb(ids)
            dist.all_reduce(h, op="not an op" if self.calls == 3 else dist.ReduceOp.SUM)
            return self.head(h)

    model, tok = LM().eval(), torch.tensor([3])
    with torch.no_grad():
        for _ in range(4):
            tok = model(tok).argmax(-1)
"""


def test_the_program_s_traceback_holds_none_of_the_collective_wrapper_s_frames(tmp_path: Path) -> None:
    """An error raised inside all_reduce showed the recorder's collective wrapper between the
    program's frame and torch's: only the step wrapper's one re-raising frame is left."""
    _script(tmp_path, "coll", _RAISES_INSIDE_A_COLLECTIVE)
    p = _replay("record", "--quiet", "--out", tmp_path / "rec", "--", sys.executable, "coll.py", cwd=tmp_path)
    assert p.returncode != 0 and 'coll.py", line' in p.stderr, p.stderr[-2000:]
    assert "replay/record/collectives.py" not in p.stderr and p.stderr.count("replay/record/") == 1, p.stderr[-3000:]
