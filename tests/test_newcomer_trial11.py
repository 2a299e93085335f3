"""Found in the twentieth session (issue 15's newcomer trials: engines nobody adapted), each a
test that failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from replay.record.calls import config_settings
from tests.test_newcomer_scripts import _record, _replay, _script

pytestmark = pytest.mark.e2e


# A setting kept on the config object beside its declared fields, as HF keeps the attention
# implementation (``config._attn_implementation_internal``, eager or sdpa) out of ``to_dict()``
# and out of the dataclass's fields.
_SETTING_BESIDE_THE_FIELDS = """
    import sys
    from dataclasses import dataclass
    import torch, torch.nn as nn

    @dataclass
    class Config:
        dim: int = 16
        vocab: int = 40

    class Model(nn.Module):
        def __init__(self, config, impl):
            super().__init__()
            self.config = config
            config._impl = impl
            self.emb = nn.Embedding(config.vocab, config.dim)
            self.head = nn.Linear(config.dim, config.vocab)
        def forward(self, ids):
            h = self.emb(ids)
            h = torch.softmax(h, -1) if self.config._impl == "eager" else torch.softmax(h.double(), -1).float()
            return self.head(h)

    torch.manual_seed(0)
    model = Model(Config(), sys.argv[1]).eval()
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):
            ids = model(ids).argmax(-1)
"""


def test_diff_names_a_setting_kept_beside_the_config_s_fields(tmp_path) -> None:
    """HF's ``attn_implementation="eager"`` against ``"sdpa"``: ``diff`` said "config the same"
    (the setting is an attribute of the config object, not one of its fields); it names it."""
    _script(tmp_path, "impl", _SETTING_BESIDE_THE_FIELDS)
    recs = []
    for impl in ("eager", "fused"):
        out = tmp_path / f"rec-{impl}"
        p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "impl.py", impl, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        recs.append(out)
    d = _replay("diff", *recs, cwd=tmp_path)
    assert "config._impl: A eager, B fused" in d.stdout, d.stdout


def test_config_settings_are_plain_values_beside_the_declared_fields() -> None:
    @dataclasses.dataclass
    class Config:
        dim: int = 4

    c = Config()
    c._attn_implementation_internal = "sdpa"
    c._cache = object()  # not a plain value: left out
    assert config_settings(c) == {"_attn_implementation_internal": "sdpa"}
    assert config_settings({"dim": 4}) == {}  # a dict config holds all it has in its fields already


# Tensor parallelism on two CPU ranks (mp.spawn, gloo): a column/row-parallel MLP whose partial
# sums are all-reduced, the vocab-parallel head all-gathered, and the loop all-gathering the
# sampled token between steps (as replicated engines keep ranks in lockstep). With DRIFT set,
# rank 1 rounds its MLP output otherwise (x * 3 / 3) after the all_reduce of the call K.
# ASYNC=1 starts the all_reduces with async_op=True and waits on them (FUTURE=1: on their
# futures), then writes into their outputs in place.
_TENSOR_PARALLEL = """
    import os, socket, torch, torch.nn as nn, torch.nn.functional as F
    import torch.distributed as dist
    import torch.multiprocessing as mp

    K = 5
    DRIFT = os.environ.get("DRIFT") == "1"
    DIE = os.environ.get("DIE") == "1"
    PARTIAL = os.environ.get("PARTIAL") == "1"
    ASYNC = os.environ.get("ASYNC") == "1"
    FUTURE = os.environ.get("FUTURE") == "1"

    class TPMLP(nn.Module):
        def __init__(s, d, rank, ws):
            super().__init__()
            s.rank = rank
            s.fc1 = nn.Linear(d, 4 * d // ws)
            s.fc2 = nn.Linear(4 * d // ws, d, bias=False)
            s.calls = 0
        def forward(s, x):
            p = s.fc2(F.gelu(s.fc1(x)))
            if PARTIAL and s.rank == 1 and s.calls == K:
                p = p + 1e-4  # before the all_reduce: every rank gets the changed sum
            if ASYNC and FUTURE:
                dist.all_reduce(p, async_op=True).get_future().wait()
                p.mul_(1.0)  # written after the collective, in place
            elif ASYNC:
                dist.all_reduce(p, async_op=True).wait()
                p.mul_(1.0)  # written after the collective, in place
            else:
                dist.all_reduce(p)
            if DRIFT and s.rank == 1 and s.calls == K:
                p = (p * 3.0) / 3.0
            s.calls += 1
            return p

    class TPLM(nn.Module):
        def __init__(s, rank, ws, vocab=96, d=32):
            super().__init__()
            s.ws = ws
            s.emb = nn.Embedding(vocab, d)
            s.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
            s.mlps = nn.ModuleList(TPMLP(d, rank, ws) for _ in range(2))
            s.head = nn.Linear(d, vocab // ws, bias=False)
        def forward(s, ids):
            x = s.emb(ids)
            for n, m in zip(s.norms, s.mlps):
                x = x + m(n(x))
            loc = s.head(x[:, -1])
            parts = [torch.empty_like(loc) for _ in range(s.ws)]
            dist.all_gather(parts, loc)
            return torch.cat(parts, -1)

    def worker(rank, ws, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
        torch.manual_seed(1234 + rank)
        model = TPLM(rank, ws)
        ids = torch.tensor([[1, 2, 3]])
        with torch.inference_mode():
            for i in range(8):
                if DIE and rank == 1 and i == K:
                    os._exit(3)  # a rank gone: its peer's next collective raises
                nxt = model(ids).argmax(-1, keepdim=True)
                both = [torch.empty_like(nxt) for _ in range(ws)]
                dist.all_gather(both, nxt)
                ids = torch.cat([ids, both[0]], 1)
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if DIE:
            # Each rank waited on by itself: mp.spawn's join stops the other ranks once one has
            # failed, and could stop rank 0 before its collective with the gone rank raised.
            ctx = mp.spawn(worker, args=(2, port), nprocs=2, join=False)
            for proc in ctx.processes:
                proc.join()
            raise SystemExit(max(proc.exitcode for proc in ctx.processes))
        mp.spawn(worker, args=(2, port), nprocs=2)
"""


def _record_tp(tmp_path, name: str, *flags: str, ok: bool = True, **env: str):
    import os

    _script(tmp_path, "tp", _TENSOR_PARALLEL)
    out = tmp_path / f"rec-{name}"
    from tests.test_newcomer_scripts import _env

    p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(out), *flags, "--", sys.executable,
                        "tp.py"], cwd=tmp_path, env={**_env(), **env}, capture_output=True, text=True, timeout=300)
    assert (p.returncode == 0) is ok, p.stderr[-2000:]
    return out


def test_diff_names_the_rank_whose_collective_input_changed(tmp_path) -> None:
    """Rank 1 changed its partial sum before the all_reduce: every rank's all_reduce output
    differs from the clean run's, and diff blamed rank 0 (the lowest rank). It says whose input
    to that collective differs."""
    clean, changed = _record_tp(tmp_path, "clean"), _record_tp(tmp_path, "partial", PARTIAL="1")
    d = _replay("diff", clean, changed, cwd=tmp_path)
    head = d.stdout.splitlines()[0]
    assert "collective.0.all_reduce first differs" in head and "its input differs only on rank 1 " in head, d.stdout


def test_a_step_that_raised_inside_a_collective_when_recorded_is_not_compared(tmp_path) -> None:
    """Rank 1 died; rank 0's next step raised inside its all_reduce (the peer gone). Re-running
    that step said "the rebuilt target does not follow the recorded code path"; it says the step
    raised there when recorded, and that it is not compared."""
    out = _record_tp(tmp_path, "die", ok=False, DIE="1")
    s = _replay("step", out, "--rank", "0", "--step", "4", "--no-save", cwd=tmp_path)
    assert s.returncode != 0 and "reproduced" not in s.stdout, s.stdout
    last = s.stderr.strip().splitlines()[-1]
    assert "step 4 raised when recorded" in last and "not compared" in last, s.stderr[-2000:]


def test_a_rank_whose_collective_input_departed_is_not_reproduced(tmp_path) -> None:
    """Rank 1 rounded otherwise after an all_reduce (an environment variable set when recorded,
    not in the re-run): the next collective's input differs, and a one-rank re-run hands every
    collective its recorded result, so the step's outputs matched. It said "reproduced ... bit
    for bit", and bisect --against-rerun "no departure"; both now name the collective."""
    out = _record_tp(tmp_path, "drift", DRIFT="1")
    s = _replay("step", out, "--rank", "1", "--step", "4", "--no-save", cwd=tmp_path)
    head = s.stdout.splitlines()[0] if s.stdout else ""
    assert head.startswith("not reproduced: rank 1 step 4"), s.stdout + s.stderr[-2000:]
    assert "collective #1 (all_reduce) input differs from the recorded one" in head, head
    b = _replay("bisect", "steps", out, "--against-rerun", "--rank", "1", "--no-save", cwd=tmp_path)
    assert "first departs from the recording at step 4 (collective #1 (all_reduce) input)" in b.stdout, b.stdout + b.stderr[-2000:]


def test_collectives_the_loop_makes_between_steps_are_not_the_steps(tmp_path) -> None:
    """The loop all-gathers the sampled token after each call of the model: every re-run
    failed with "the re-run made 0 collectives, the recording has 1" (they were charged to the
    step before). Only the step's own collectives are replayed in it."""
    out = _record_tp(tmp_path, "clean")
    s = _replay("step", out, "--rank", "0", "--step", "3", "--no-save", cwd=tmp_path)
    assert s.returncode == 0, s.stdout + s.stderr[-2000:]
    assert s.stdout.startswith("reproduced: rank 0 step 3 re-ran bit for bit"), s.stdout


def test_an_async_collective_is_named_as_such_when_a_rank_cannot_be_replayed_alone(tmp_path) -> None:
    """An all_reduce started with async_op=True has no output when the call returns: only its
    input is recorded then. The error sent the user to --collectives full. Its output is taken
    when the program waits on its work, or else at the step's end if the work is done by then and
    the program has not written into it since: waited on through its future and written in place,
    the rank still cannot be replayed alone, and the error says why."""
    out = _record_tp(tmp_path, "async", "--collectives", "full", ASYNC="1", FUTURE="1")
    s = _replay("step", out, "--rank", "1", "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode != 0
    assert "was called with async_op=True" in s.stderr and "--collectives full" not in s.stderr.splitlines()[-1], s.stderr[-2000:]


def test_an_async_collective_waited_on_in_its_step_is_replayed_alone(tmp_path) -> None:
    """``dist.all_reduce(p, async_op=True).wait()`` inside the step, then ``p.mul_(1.0)``: the
    output is recorded when the program waits (before its write), and one rank re-runs alone with
    it (it said "cannot be replayed alone")."""
    from tests.test_newcomer_scripts import _env

    out = _record_tp(tmp_path, "async-waited", "--collectives", "full", ASYNC="1")
    s = subprocess.run([sys.executable, "-m", "replay", "step", str(out), "--rank", "1", "--step", "2", "--no-save"],
                       cwd=tmp_path, env={**_env(), "ASYNC": "1"}, capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stdout + s.stderr[-2000:]
    assert s.stdout.startswith("reproduced: rank 1 step 2 re-ran bit for bit"), s.stdout


_INHERITED_FORWARD = """
    import torch, torch.nn as nn

    class Base(nn.Module):
        def __init__(s, d):
            super().__init__()
            s.lin = nn.Linear(d, d)
        def forward(s, x):
            return s.lin(x).tanh()

    class Small(Base):
        def __init__(s):
            super().__init__(8)

    torch.manual_seed(0)
    m = Small()
    x = torch.randn(1, 8)
    with torch.no_grad():
        for _ in range(6):
            x = m(x)
"""


def test_a_module_whose_forward_a_base_class_defines_is_re_run(tmp_path) -> None:
    """``class Small(Base)`` with Base's forward (a draft and a target subclassing one LM): the
    re-launched program 'ended without calling the recorded step', though it called it 6 times."""
    _script(tmp_path, "inherits", _INHERITED_FORWARD)
    out, _ = _record(tmp_path, "inherits")
    s = _replay("step", out, "--step", "2", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced: rank 0 step 2"), s.stdout + s.stderr[-2000:]


# A counter the module keeps and computes with, a factory that builds the module afresh, and a
# step found with no flags (its first call, the prefill, is not recorded: it moved the counter).
_COUNTER_AND_FACTORY = """
    import torch, torch.nn as nn

    class Net(nn.Module):
        def __init__(s):
            super().__init__()
            s.lin = nn.Linear(8, 8)
            s.t = 0
        def forward(s, x):
            y = torch.tanh(s.lin(x) * (1 + 0.1 * s.t))
            s.t += 1
            return y

    def build(config, *, rank, world_size, device, options):
        torch.manual_seed(0)
        return Net()

    if __name__ == "__main__":
        m = build(None, rank=0, world_size=1, device="cpu", options={})
        x = torch.ones(1, 8)
        with torch.no_grad():
            for _ in range(6):
                x = m(x)
"""


def test_a_factory_built_target_gets_the_counter_the_unrecorded_first_call_moved(tmp_path) -> None:
    """With --factory, the rebuilt module starts at t=0 while the recorded step 0 ran at t=1
    (the prefill, not recorded, moved it): every step re-ran one off, "not reproduced", and
    bisect layers between ranks compared the wrong steps. Keyframe 0's counter is set."""
    _script(tmp_path, "counter", _COUNTER_AND_FACTORY)
    out, _ = _record(tmp_path, "counter", "--factory", "counter:build")
    s = _replay("step", out, "--step", "3", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced: rank 0 step 3"), s.stdout + s.stderr[-2000:]


_GLOBAL_POSITION = """
    import torch, torch.nn as nn
    POS = 0

    class Rot(nn.Module):
        def __init__(s, d=16, vocab=40):
            super().__init__()
            s.emb = nn.Embedding(vocab, d); s.lin = nn.Linear(d, d); s.head = nn.Linear(d, vocab)
            s.register_buffer("acc", torch.zeros(1, d))
        def forward(s, tok):
            global POS
            x = s.emb(tok) * (1 + 0.05 * POS)
            s.acc.add_(torch.tanh(s.lin(x)))
            POS += 1
            return s.head(s.acc)

    torch.manual_seed(0)
    m = Rot(); tok = torch.tensor([3])
    with torch.no_grad():
        for _ in range(10):
            tok = m(tok).argmax(-1)
"""


def test_a_step_after_a_keyframe_that_lacks_a_module_global_is_re_run_from_step_zero(tmp_path) -> None:
    """The position lives in a module global: from the keyframe at step 4, step 6 departed
    ("name all of it with --state", which cannot name a global) while bisect --against-rerun,
    running on from step 0, found no departure. replay step now re-runs from step 0 then."""
    _script(tmp_path, "globalpos", _GLOBAL_POSITION)
    out, _ = _record(tmp_path, "globalpos", "--keyframe-every", "4")
    s = _replay("step", out, "--step", "6", "--no-save", cwd=tmp_path)
    assert s.returncode == 0 and s.stdout.startswith("reproduced: rank 0 step 6"), s.stdout + s.stderr[-2000:]
    assert "departed at that step itself" in s.stdout and "a module global" in s.stdout, s.stdout


def test_a_nan_against_a_number_is_named_beside_the_finite_differences() -> None:
    """'1/30 elements differ, max abs 0, max rel 0, 0 ulp' for a NaN against a number."""
    import torch

    from replay.analysis.compare import compare_tensors

    a = torch.ones(2, 5)
    b = a.clone()
    b[0, 1] = float("nan")
    c = compare_tensors(a, b, name_a="re-run", name_b="rank 0")
    assert not c.equal
    assert "1 element(s) NaN or inf on one side only (re-run: finite; rank 0: 1 NaN)" in str(c), str(c)
    assert compare_tensors(b, b.clone()).equal  # NaN in the same place on both sides: the same bits


def test_launcher_variables_are_not_environment_differences() -> None:
    """torchrun sets GROUP_WORLD_SIZE and TORCH_NCCL_ASYNC_ERROR_HANDLING: a re-launch without
    torchrun listed them as 'not set here' beside the variable that mattered."""
    from replay.core.environment import env_differences, env_digests

    recorded = env_digests({"GROUP_WORLD_SIZE": "2", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "DRIFT": "1"})
    assert env_differences(recorded, {}) == ["DRIFT (not set here)"]


_ENDS_ON_AN_ERROR = """
    import torch
    m = torch.nn.Linear(4, 4)
    x = torch.ones(1, 4)
    with torch.no_grad():
        for i in range(6):
            x = torch.tanh(m(x))
            if i == 4:
                raise FloatingPointError("NaN logits on this rank")
"""


def test_info_names_the_error_a_rank_s_program_ended_on(tmp_path) -> None:
    """A rank whose program raised outside its steps (its own check of the logits): info named
    only its peer's error (a closed connection in the next collective), never the rank that
    failed. The error is kept in the rank's end marker and shown."""
    _script(tmp_path, "ends", _ENDS_ON_AN_ERROR)
    p = _replay("record", "--quiet", "--out", tmp_path / "rec", "--", sys.executable, "ends.py", cwd=tmp_path)
    assert p.returncode == 1 and "FloatingPointError" in p.stderr  # the program's own traceback, as without replay
    info = _replay("info", tmp_path / "rec", cwd=tmp_path)
    assert "rank 0: its program ended on an uncaught FloatingPointError: NaN logits on this rank" in info.stdout, info.stdout
    import json

    data = json.loads(_replay("info", tmp_path / "rec", "--json", cwd=tmp_path).stdout)
    assert data["ranks"][0]["uncaught"] == "FloatingPointError: NaN logits on this rank"


_READS_A_VARIABLE_IN_FORWARD = """
    import os, torch, torch.nn as nn

    class Net(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = nn.Linear(8, 8); s.b = nn.Linear(8, 8)
        def forward(s, x):
            h = torch.tanh(s.a(x))
            if os.environ.get("DRIFT") == "1":
                h = h * 1.0001
            return s.b(h)

    def build(config, *, rank, world_size, device, options):
        torch.manual_seed(0)
        return Net()

    if __name__ == "__main__":
        m = build(None, rank=0, world_size=1, device="cpu", options={})
        x = torch.ones(1, 8)
        with torch.no_grad():
            for _ in range(5):
                x = m(x)
"""


def test_bisect_layers_says_on_its_first_line_that_a_side_s_re_run_does_not_reproduce_it(tmp_path) -> None:
    """Run B read DRIFT=1 when recorded; its re-run here does not. The layer verdict is about the
    re-runs, so the first line says so (it was a last note under the table)."""
    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "envdrift", _READS_A_VARIABLE_IN_FORWARD)
    for name, env in (("a", {}), ("b", {"DRIFT": "1"})):
        p = subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", "--out", str(tmp_path / name), "--factory",
                            "envdrift:build", "--", sys.executable, "envdrift.py"], cwd=tmp_path, env={**_env(), **env},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    b = _replay("bisect", "layers", "--between", "run:a,run:b", "--step", "2", "--no-save", cwd=tmp_path)
    first = b.stdout.splitlines()[0]
    assert "but run B's re-run does not reproduce rank 0's recorded outputs at this step" in first, b.stdout + b.stderr[-2000:]
