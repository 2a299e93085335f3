"""Found in the twenty-fifth session's newcomer trials (engines nobody adapted), each a test that
failed before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_newcomer_scripts import _replay, _script

pytestmark = pytest.mark.e2e

# An engine samples through a callable sampler object that holds its own generators (a torch one
# and a numpy one): `self.sampler(logits)`, the usual form. Recorded with a factory.
_CALLABLE_SAMPLER = """
    import argparse, numpy as np, torch, torch.nn as nn
    V, D = 32, 16
    class Model(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(V, D); self.a = nn.Linear(D, D); self.head = nn.Linear(D, V)
        def forward(self, x): return self.head(torch.tanh(self.a(x)))
    class Sampler:
        def __init__(self, kind, seed):
            self.kind = kind
            self.rng = np.random.default_rng(seed)
            self.g = torch.Generator().manual_seed(seed)
        def __call__(self, logits):
            p = torch.softmax(logits.double(), -1)
            if self.kind == "np":
                u = self.rng.random()
                return torch.searchsorted(p.cumsum(-1), torch.tensor([[u]], dtype=torch.float64)).clamp(max=V - 1)
            return torch.multinomial(p, 1, generator=self.g)
    class Engine:
        def __init__(self, cfg):
            self.cfg = dict(cfg); torch.manual_seed(0)
            self.model = Model().eval(); self.sampler = Sampler(cfg["kind"], cfg["seed"])
            self.hist = torch.zeros(1, 16)
        def replay_config(self): return self.cfg
        def state(self): return {"hist": self.hist}
        def step(self, ids):
            with torch.no_grad():
                self.hist.mul_(0.5).add_(self.model.emb(ids))
                logits = self.model(self.hist)
                tok = self.sampler(logits)
            return {"logits": logits, "tokens": tok}
    def build(config, *, rank=0, world_size=1, device="cpu", options=None): return Engine(config)
    if __name__ == "__main__":
        p = argparse.ArgumentParser(); p.add_argument("--kind", default="np"); a = p.parse_args()
        eng = Engine({"seed": 11, "kind": a.kind}); ids = torch.tensor([3])
        for i in range(10):
            ids = eng.step(ids)["tokens"].view(1)
"""


@pytest.mark.parametrize("kind", ["torch", "np"])
def test_a_callable_sampler_s_generator_is_kept_and_the_step_reproduces(tmp_path: Path, kind: str) -> None:
    _script(tmp_path, "samp", _CALLABLE_SAMPLER)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--step", "samp:Engine.step", "--state", "state", "--config", "replay_config",
                "--factory", "samp:build", "--keyframe-every", "4", "--", sys.executable, "samp.py", "--kind", kind, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "not reproduced: ... tokens is different" (the sampler's generator was never kept),
    # and --repeat blamed a nondeterministic kernel.
    p = _replay("step", rec, "--rank", 0, "--step", 6, "--repeat", 2, "--json", "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["headline"].startswith("reproduced:"), out["headline"]
    assert any("sampler.g" in n and "sampler.rng" in n for n in out["notes"]), out["notes"]
    assert all(m["repeats_equal"] for m in out["modes"].values()), out["modes"]


# A model holds a seeded numpy Generator and adds noise from it in forward.
_NUMPY_NOISE = """
    import numpy as np, torch, torch.nn as nn
    torch.manual_seed(0)
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16); self.l1 = nn.Linear(16, 16); self.out = nn.Linear(16, 32)
            self.rng = np.random.default_rng(42)
        def forward(self, ids):
            logits = self.out(torch.tanh(self.l1(self.emb(ids).mean(1))))
            return logits + torch.from_numpy(self.rng.gumbel(size=logits.shape).astype(np.float32))
    m = Noisy().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for i in range(8):
            ids = torch.cat([ids, m(ids).argmax(-1, keepdim=True)], 1)
"""


def test_repeats_of_a_model_drawing_from_its_own_numpy_generator_give_the_same_bits(tmp_path: Path) -> None:
    _script(tmp_path, "np_noise", _NUMPY_NOISE)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--keyframe-every", 3, "--out", rec, "--", sys.executable, "np_noise.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "repeated runs of the same step from the same state gave different bits: a
    # nondeterministic kernel, or ... an unseeded random source", for a seeded generator.
    p = _replay("step", rec, "--rank", 0, "--step", 5, "--repeat", 3, "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced:"), p.stdout
    assert "nondeterministic" not in p.stdout and "bits vary" not in p.stdout, p.stdout
    assert "rng" in p.stdout, p.stdout


_EXITS_MID_LOOP = """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    x = torch.ones(1, 8)
    with torch.no_grad():
        for i in range(8):
            if i == 5:
                sys.exit(3)
            x = torch.tanh(m(x))
"""


def test_info_says_the_recorded_command_exited_with_a_non_zero_code(tmp_path: Path) -> None:
    _script(tmp_path, "ex", _EXITS_MID_LOOP)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "ex.py", cwd=tmp_path)
    assert p.returncode == 3, p.stderr[-2000:]  # replay record passes the program's own exit code on
    # Before: info showed 4 complete steps and nothing of the exit (the manifest had it).
    p = _replay("info", rec, cwd=tmp_path)
    assert "ex.py   (exited with code 3)" in p.stdout, p.stdout
    out = json.loads(_replay("info", rec, "--json", cwd=tmp_path).stdout)
    assert out["command_exit_code"] == 3 and out["command_signal"] is None


# A beam search reorders the model's cache between steps (index_select on the beams kept).
_BEAM_SEARCH = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    V, D, B, T = 32, 16, 4, 32
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D); self.l1 = nn.Linear(D, D); self.out = nn.Linear(D, V)
            self.register_buffer("cache", torch.zeros(B, T, D))
            self.register_buffer("pos", torch.zeros((), dtype=torch.long))
        def forward(self, ids):
            n = ids.shape[1]; p = int(self.pos)
            h = self.emb(ids)
            self.cache[:, p:p+n] = h
            self.pos += n
            ctx = self.cache[:, :p+n].mean(1)
            return torch.log_softmax(self.out(torch.tanh(self.l1(h[:, -1] + ctx))), -1)
    m = Tiny().eval()
    ids = torch.tensor([[1, 2, 3]]).repeat(B, 1)
    scores = torch.tensor([0.0] + [-1e9] * (B - 1))
    with torch.no_grad():
        for step in range(8):
            cand = (scores[:, None] + m(ids)).view(-1)
            top, idx = cand.topk(B)
            m.cache.copy_(m.cache.index_select(0, idx // V))
            scores = top; ids = (idx % V)[:, None]
"""


def test_bisect_steps_against_a_rerun_gives_the_keyframe_remedy_replay_step_gives(tmp_path: Path) -> None:
    _script(tmp_path, "beam", _BEAM_SEARCH)
    rec = tmp_path / "rec"
    p = _replay("record", "--quiet", "--out", rec, "--", sys.executable, "beam.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    # Before: "first departs from the recording at step 1 (output.logits)" and no remedy, where
    # `replay step` says a keyframe every step restores state the program changes between steps.
    p = _replay("bisect", "steps", rec, "--against-rerun", "--rank", 0, "--no-save", cwd=tmp_path)
    assert "first departs from the recording at step 1" in p.stdout, p.stdout
    assert "a keyframe every step restores it: replay record --keyframe-every 1" in p.stdout, p.stdout


# The recorder used in-process by a script whose loop is at its top level (no __main__ guard);
# the step it names is a class of that script.
_SCRIPT_WITH_ITS_OWN_RECORDER = """
    import os, torch, torch.nn as nn
    from pathlib import Path
    from replay import Recorder, RecorderConfig
    torch.manual_seed(0)
    class LM(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(16, 8); self.head = nn.Linear(8, 16)
        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))
    m = LM().eval()
    Path("ran-" + str(os.getpid())).touch()
    rec = Recorder(RecorderConfig(out="rec", rank=0, world_size=1))
    rec.set_target({"step": "inproc:LM"})
    ids = torch.tensor([[1, 2]])
    with torch.no_grad():
        for s in range(4):
            with rec.step():
                rec.record_inputs(ids=ids)
                logits = m(ids)
                rec.record_outputs(logits=logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    rec.close()
"""


def test_a_re_run_never_imports_a_script_whose_top_level_runs_its_program(tmp_path: Path) -> None:
    import subprocess

    from tests.test_newcomer_scripts import _env

    _script(tmp_path, "inproc", _SCRIPT_WITH_ITS_OWN_RECORDER)
    p = subprocess.run([sys.executable, "inproc.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before = sorted(x.name for x in (tmp_path / "rec" / "run-000").iterdir())
    # Before: importing inproc:LM ran the script's whole loop inside replay (a second "ran-"
    # marker), whose recorder left an empty journal in the recording, which `replay seal` then
    # sealed over the rank's steps.
    p = _replay("step", "rec", "--rank", 0, "--step", 2, "--trust", cwd=tmp_path)
    assert p.returncode == 6, p.stdout + p.stderr
    assert "importing inproc" in p.stderr and "would run its program: its top level runs a with block" in p.stderr, p.stderr
    assert len(list(tmp_path.glob("ran-*"))) == 1
    assert sorted(x.name for x in (tmp_path / "rec" / "run-000").iterdir()) == before
