"""Recording and re-running on a GPU: device digests, CUDA graph captures, kernels, replays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replay import Recorder, RecorderConfig, open_recording
from replay.digest import digest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def _replay(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_recorder_on_cuda_tensors_matches_cpu_bits(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", ring=4, outputs="full"))
    sent = []
    for s in range(6):
        x = torch.randn(8, 3, 512, device="cuda")
        ids = torch.randint(0, 100, (8,), device="cuda")
        rec.begin_step()
        rec.record_inputs(input_ids=ids)
        rec.record_outputs(logits=x, tokens=x.argmax(-1))
        rec.end_step()
        sent.append((ids.cpu(), x.cpu()))
    rec.close()
    assert rec.error is None, rec.error
    rf = open_recording(tmp_path / "r")["run-000"][0]
    for s, (ids, x) in enumerate(sent):
        view = rf.step(s)
        assert torch.equal(view.inputs["input_ids"], ids)
        fields = dict(view.fields())
        assert fields["output.logits"] == digest(x)  # device digest == CPU reference
        top = x.topk(2, dim=-1).values
        assert float(view.margin) == pytest.approx(float((top[..., 0] - top[..., 1]).min()))
        assert torch.equal(view.tensors(__import__("replay.format", fromlist=["TensorKind"]).TensorKind.OUTPUT)["logits"], x)


def test_small_cuda_views_are_recorded_with_the_values_the_program_saw(tmp_path):
    """Small CUDA tensors are packed as bytes: a strided 1-D view, a lazy conjugate and a lazy
    negation are recorded with their values (they once stopped the recording)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(60, device="cuda", generator=g)
    z = torch.randn(3, 4, dtype=torch.complex64, device="cuda", generator=g)
    cases = {"strided": base[::3], "conj": z.conj(), "neg": torch._neg_view(base[:5]), "plain": base[10:20]}
    rec = Recorder(RecorderConfig(out=tmp_path / "r"))
    for _ in range(3):  # past the first steps: the captured side work too
        rec.begin_step()
        rec.record_inputs(**cases)
        rec.end_step()
    rec.close()
    assert rec.error is None, rec.error
    with open_recording(tmp_path / "r") as r:
        rf = r["run-000"][0]
        for s in range(3):
            inputs = rf.step(s).inputs
            for name, t in cases.items():
                assert torch.equal(inputs[name], t.resolve_conj().resolve_neg().cpu()), (s, name)


def test_the_record_is_of_the_step_end_even_when_the_program_then_overwrites_its_outputs(tmp_path):
    """The record's device work runs on a side stream after the step: what it digests, stores
    and takes the margin of must be the outputs as the step returned them, not what the program
    wrote into the same buffers afterwards; and the program's own stream is current again."""
    rec = Recorder(RecorderConfig(out=tmp_path / "r", ring=4, outputs="full"))
    logits = torch.empty(8, 3, 4096, device="cuda")  # one static buffer, like a graph's output
    ids = torch.empty(8, dtype=torch.int64, device="cuda")
    program_stream = torch.cuda.Stream()
    sent = []
    with torch.cuda.stream(program_stream):
        for s in range(8):
            ids.copy_(torch.randint(0, 100, (8,), device="cuda"))
            rec.begin_step()
            rec.record_inputs(input_ids=ids)
            logits.normal_()
            torch.cuda._sleep(2_000_000)  # a long step: the record's copies would race the writes below
            rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
            rec.end_step()
            assert torch.cuda.current_stream() == program_stream
            sent.append((ids.cpu(), logits.cpu()))
            ids.fill_(-1)  # the program reuses its buffers at once
            logits.fill_(float("nan"))
    captured = rec._staging.plans.captured
    rec.close()
    assert rec.error is None, rec.error
    assert captured >= 1, "the side work of the later steps ran as a captured graph"
    rf = open_recording(tmp_path / "r")["run-000"][0]
    from replay.format import TensorKind

    for s, (i, x) in enumerate(sent):
        view = rf.step(s)
        assert torch.equal(view.inputs["input_ids"], i)
        assert dict(view.fields())["output.logits"] == digest(x)
        assert torch.equal(view.tensors(TensorKind.OUTPUT)["logits"], x)
        top = x.topk(2, dim=-1).values
        assert float(view.margin) == pytest.approx(float((top[..., 0] - top[..., 1]).min()))


def test_each_step_keeps_its_own_small_tensors_as_the_step_area_grows(tmp_path):
    """A step's small CUDA tensors are packed into one buffer kept from step to step (one copy
    a call, one copy into the ring a step), which grows when a step needs more. Before and after
    it grows, inside and outside inference mode, with the program overwriting its tensors as soon
    as the step ends, each step's record holds the values of its own step."""
    from replay.format import TensorKind

    rec = Recorder(RecorderConfig(out=tmp_path / "r", outputs="full"))
    outs = [torch.empty(1024, device="cuda") for _ in range(40)]  # 160 KiB a step: past the first area
    ids = torch.empty(8, dtype=torch.int64, device="cuda")
    flags = torch.empty(3, dtype=torch.bool, device="cuda")
    sent = []
    for s in range(6):
        n = 3 if s == 0 else 40  # step 1 does not fit the first area; later steps fit the grown one
        with torch.inference_mode(s % 2 == 1):
            ids.copy_(torch.arange(8, device="cuda") + 100 * s)
            rec.begin_step()
            rec.record_inputs(input_ids=ids)
            for i in range(n):
                outs[i].fill_(s * 1000 + i)
            flags.copy_(torch.tensor([s % 2 == 0, True, s > 2], device="cuda"))
            rec.record_probe("sampler", flags=flags)
            rec.record_outputs(**{f"o{i}": outs[i] for i in range(n)})
            rec.end_step()
        sent.append((ids.cpu(), flags.cpu(), [o.cpu() for o in outs[:n]]))
        ids.fill_(-1)  # the program reuses its buffers at once
        flags.fill_(False)
        for o in outs:
            o.fill_(float("nan"))
    rec.close()
    assert rec.error is None, rec.error
    assert rec._staging._areas, "the small tensors went into the step's area"
    with open_recording(tmp_path / "r") as r:
        rf = r["run-000"][0]
        assert rf.n_steps == 6
        for s, (i, f, o) in enumerate(sent):
            view = rf.step(s)
            assert torch.equal(view.inputs["input_ids"], i), s
            got = view.tensors(TensorKind.OUTPUT)
            assert len([k for k in got if k.startswith("o")]) == len(o), s
            for k, want in enumerate(o):
                assert torch.equal(got[f"o{k}"], want), (s, k)
            tokens = view.tensors(TensorKind.TOKENS)
            assert torch.equal(tokens["sampler.flags"], f), s


def test_a_commit_word_written_by_the_stream_lands_only_after_the_work_before_it(tmp_path):
    """The record ring's commit word, written by the driver's stream write: it lands once the
    work queued before it on the stream (a long kernel, then a copy to the host) has finished,
    never before; and a recorder switched to it (not the default: a device counter and a copy)
    commits its CUDA jobs this way and records each step's values."""
    from replay.record.stream_write import open_stream_writer

    writer = open_stream_writer(torch.device("cuda", 0))
    if writer is None:
        pytest.skip("this driver refuses stream memory operations (the recorder commits by a copy)")
    host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    address = writer.device_pointer(host.data_ptr())
    assert address is not None
    stream = torch.cuda.Stream()
    src = torch.full((1,), 7, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # about a tenth of a second of device time
        host[1:2].copy_(src, non_blocking=True)
    assert writer.write(stream.cuda_stream, address, 42)
    assert int(host[0]) == 0 and int(host[1]) == 0  # queued behind the kernel and the copy
    stream.synchronize()
    assert int(host[0]) == 42 and int(host[1]) == 7

    rec = Recorder(RecorderConfig(out=tmp_path / "r"))
    rec._staging.driver_commit = True
    sent = []
    for s in range(3):
        x = torch.randn(4, 1000, device="cuda")
        rec.begin_step()
        rec.record_outputs(logits=x)
        rec.end_step()
        sent.append(x.cpu())
    assert [c.writer is not None for c in rec._staging._commits.values()] == [True]
    rec.close()
    assert rec.error is None, rec.error
    with open_recording(tmp_path / "r") as r:
        rf = r["run-000"][0]
        assert rf.n_steps == 3
        assert [dict(rf.step(s).fields())["output.logits"] for s in range(3)] == [digest(x) for x in sent]


@pytest.fixture(scope="module")
def graphed_recording(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "rec"
    p = _replay("record", "--out", str(out), "--quiet", "--step", "tests.gpu_toy:GraphedEngine.step",
                "--state", "state_tensors", "--config", "replay_config", "--factory", "tests.gpu_toy:build",
                "--keyframe-every", "5", "--", sys.executable, "-m", "tests.gpu_toy", "12")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_cuda_graph_capture_kernels_and_replays_are_recorded(graphed_recording):
    rf = open_recording(graphed_recording)["run-000"][0]
    t = rf.full()
    assert t.graphs.size == 1, "one torch.cuda.CUDAGraph capture"
    g = t.graphs[0]
    assert int(g["n_kernels"]) >= 3, "kernels listed from the graph's DOT dump"
    names = [t.string(int(k["name"])) for k in t.kernels]
    assert any("gemm" in n.lower() or "sgemm" in n.lower() or "cutlass" in n.lower() or "matmul" in n.lower() for n in names), names
    assert all(int(k["block"][0]) > 0 for k in t.kernels)
    assert (t.steps["mode"] == 2).all(), "every step replayed the graph"
    assert t.replays.size == 12 and set(t.replays["graph"]) == {int(g["graph"])}


def test_cudagraph_rerun_reproduces_recorded_bits(graphed_recording):
    p = _replay("step", str(graphed_recording), "--rank", "0", "--step", "9", "--mode", "both", "--device", "cuda", "--json", "--no-save")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    graph = data["modes"]["cudagraph"]
    assert graph["departed"] is None
    assert graph["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert data["modes"]["eager"]["vs_recording"]["tokens"]["verdict"] == "bitwise equal"


def test_generic_graph_mode_for_a_target_without_graphs(graphed_recording):
    p = _replay("step", str(graphed_recording), "--rank", "0", "--step", "7", "--mode", "cudagraph", "--device", "cuda",
                "--factory", "tests.gpu_toy:build_plain", "--json", "--no-save")
    assert p.returncode == 0, p.stderr
    graph = json.loads(p.stdout)["modes"]["cudagraph"]
    assert graph["departed"] is None
    assert graph["vs_recording"]["logits"]["verdict"] == "bitwise equal"


def test_mtp_engine_recorded_and_rerun_under_cuda_graphs(tmp_path):
    out = tmp_path / "mtp"
    p = _replay("record", "--out", str(out), "--quiet", "--keyframe-every", "10", "--", sys.executable, "-m",
                "replay.workloads.mtp", "--device", "cuda", "--cudagraph", "--ranks", "1", "--steps", "40", "--preset", "small")
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(_replay("info", str(out), "--json").stdout)
    r0 = info["ranks"][0]
    assert r0["steps"] == 40 and r0["graph_steps"] >= 39 and r0["graphs_captured"] >= 1
    rf = open_recording(out)["run-000"][0]
    assert int(rf.full().graphs["n_kernels"].max()) > 10
    p = _replay("step", str(out), "--rank", "0", "--step", "33", "--mode", "both", "--json", "--no-save")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["device"].startswith("cuda")
    assert data["modes"]["cudagraph"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"
    assert data["modes"]["cudagraph"]["departed"] is None


@pytest.mark.multigpu
def test_two_gpu_nccl_record_and_live_rerun(tmp_path):
    out = tmp_path / "mtp2"
    p = _replay("record", "--out", str(out), "--quiet", "--keyframe-every", "10", "--", sys.executable, "-m",
                "replay.workloads.mtp", "--device", "cuda", "--cudagraph", "--ranks", "2", "--steps", "30")
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads(_replay("info", str(out), "--json").stdout)
    assert [r["steps"] for r in info["ranks"]] == [30, 30]
    assert info["first_token_divergence"] is None
    p = _replay("step", str(out), "--ranks", "0-1", "--step", "25", "--mode", "both", "--devices", "cuda:0,cuda:1", "--json")
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)["results"]
    for r in results:
        assert "error" not in r, r
        assert r["collectives"] == "live"
        assert r["modes"]["cudagraph"]["vs_recording"]["logits"]["verdict"] == "bitwise equal"


_RING_CHILD = r'''
import os, signal, sys, time
import torch
import replay.record.writer as w
from replay import Recorder, RecorderConfig
from replay.format.journal import FrameKind

out, steps, stall, drain = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
orig = w.Writer._write
def write(self, job):
    if job.kind == FrameKind.STEP and job.body.get("step", 0) >= stall:
        time.sleep(3600)  # the drain stalls: later steps survive only through the ring
    return orig(self, job)
w.Writer._write = write
torch.cuda.init()
rec = Recorder(RecorderConfig(out=out, outputs="full", keyframe_every=4, drain=drain.split("-")[0]), state_fn=lambda: {"kv": kv})
if drain == "process-stopped":  # the drain process falls behind: the steps are only in the ring
    os.kill(rec._writer._proc.pid, signal.SIGSTOP)
if drain.startswith("process"):
    print("drain", rec._writer._proc.pid, flush=True)
kv = torch.zeros(256, device="cuda")
wt = torch.randn(512, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
x = torch.zeros(8, 512, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = x @ wt
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    y = x @ wt
for i in range(steps):
    x.copy_(torch.randn(8, 512, generator=torch.Generator().manual_seed(i)).cuda())
    rec.begin_step()
    rec.record_inputs(x=x, ids=torch.arange(8, device="cuda") + i)
    g.replay()
    kv.add_(1)
    rec.record_outputs(logits=y, tokens=y.argmax(-1))
    rec.end_step()
    tok = y.argmax(-1).cpu()  # the program reads its output: the step is done
    print(i, rec.ring_stats()["cuda_registered"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.parametrize("drain", ["thread", "process", "process-stopped"])
def test_sigkill_of_a_cuda_rank_keeps_every_completed_step_through_the_ring(tmp_path, drain):
    """thread: the drain thread stalls at step 10; process: the drain process writes what the
    GPU committed after its rank is gone; process-stopped: the drain process is stopped from
    the start and killed after the rank, so every step comes back from the ring."""
    from replay.format import TensorKind, seal_part
    from replay.format.journal import FrameKind, read_journal
    from tests.test_crash import wait_until_not_live

    out = tmp_path / "rec"
    steps, stall = 30, 10
    p = subprocess.run([sys.executable, "-c", _RING_CHILD, str(out), str(steps), str(stall), drain], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-3000:]
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.strip()]
    drains = [int(ln[1]) for ln in lines if ln[0] == "drain"]
    lines = [ln for ln in lines if ln[0] != "drain"]
    assert len(lines) == steps and all(reg == "True" for _, reg in lines), "the ring was registered with CUDA"
    part = out / "run-000"
    if drain == "process-stopped":
        os.kill(drains[0], signal.SIGKILL)
    wait_until_not_live(part)
    drained = [f.body["step"] for f in read_journal(part / "rank-00000.journal").frames if f.kind == FrameKind.STEP]
    assert len(drained) <= {"thread": stall, "process": steps, "process-stopped": 0}[drain]
    sealed = seal_part(part)
    assert len(sealed) == 1 and sealed[0].steps == steps
    rf = open_recording(out)["run-000"][0]
    wt = torch.randn(512, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for i in range(steps):
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(i))
        view = rf.step(i)
        assert torch.equal(view.inputs["x"], x), i
        assert torch.equal(view.inputs["ids"], torch.arange(8) + i)
        logits = view.tensors(TensorKind.OUTPUT)["logits"]
        assert dict(view.fields())["output.logits"] == digest(logits)  # the device digest of the stored bytes
        ref = (x.cuda() @ wt).cpu()
        assert torch.allclose(logits, ref, rtol=1e-3, atol=1e-3)
        top = logits.topk(2, dim=-1).values
        assert float(view.margin) == float((top[..., 0] - top[..., 1]).min())
        assert torch.equal(view.tensors(TensorKind.TOKENS)["tokens"], logits.argmax(-1))
    kf_step, kf = rf.keyframe(steps - 1)
    assert torch.equal(kf["kv"], torch.full((256,), float(kf_step)))


_INPLACE_ENGINE = '''
import sys
import torch


class Engine:
    def __init__(self):
        torch.manual_seed(0)
        self.w = torch.randn(64, 300, device="cuda")
        self.pos = 0

    def step(self, ids, scale):
        logits = (self.w[ids.remainder(64)] * scale).float()
        ids.add_(7)  # the step changes its own argument in place
        self.pos += 1
        return {"logits": logits, "tokens": logits.argmax(-1)}


engine = Engine()
ids = torch.arange(8, device="cuda")
for s in range(int(sys.argv[1])):
    out = engine.step(ids, 0.5)
    out["tokens"].tolist()
'''


def test_arguments_are_recorded_as_they_were_before_a_step_that_changes_them(tmp_path):
    """From its second step on, a CUDA step's bookkeeping runs after the call (the early path):
    its arguments must still be recorded as they were before the step, not after it."""
    (tmp_path / "inplace_engine.py").write_text(_INPLACE_ENGINE)
    out = tmp_path / "rec"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    p = subprocess.run([sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step",
                        "inplace_engine:Engine.step", "--", sys.executable, str(tmp_path / "inplace_engine.py"), "6"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rf = open_recording(out)["run-000"][0]
    assert rf.full().steps.size == 6
    for s in range(6):
        view = rf.step(s)
        assert torch.equal(view.inputs["ids"], torch.arange(8) + 7 * s), s


_CONTEXT_ENGINE = '''
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


class Engine:
    def __init__(self):
        self.q = torch.ones(1, 1, 4, 8, device="cuda")

    def attend(self, ids):
        return {"logits": torch.nn.functional.scaled_dot_product_attention(self.q, self.q, self.q).flatten() + ids.sum()}


engine = Engine()
ids = torch.arange(4, device="cuda")
for s in range(6):
    if s < 3:
        engine.attend(ids)["logits"].tolist()
    else:
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            engine.attend(ids)["logits"].tolist()
'''


def test_a_context_set_around_later_cuda_steps_is_recorded_for_each_of_them(tmp_path):
    """The early path (a stream's later CUDA steps) reads the numerics context after the call:
    each step must still name the context the program set around it, a new one included."""
    from replay import numerics

    (tmp_path / "context_engine.py").write_text(_CONTEXT_ENGINE)
    out = tmp_path / "rec"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    p = subprocess.run([sys.executable, "-m", "replay", "record", "--out", str(out), "--quiet", "--step",
                        "context_engine:Engine.attend", "--", sys.executable, str(tmp_path / "context_engine.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rf = open_recording(out)["run-000"][0]
    assert rf.full().steps.size == 6
    ctx = [numerics.recorded_context(rf, s) for s in range(6)]
    assert all(c is not None for c in ctx)
    for s in range(3):
        assert ctx[s]["sdpa.flash"] is True and ctx[s]["grad_enabled"] is True, s
    for s in range(3, 6):
        assert ctx[s]["sdpa.flash"] is False and ctx[s]["sdpa.math"] is True and ctx[s]["grad_enabled"] is False, s
    # Steps 1-5 ran on the early path. torch sets the SDPA backends' priority at the first
    # attention call: read before the call, step 0 named a third context (seen on an H200).
    assert ctx[0] == ctx[1] == ctx[2] and ctx[3] == ctx[4] == ctx[5]
    assert len(rf.attrs["target"]["numerics"]["contexts"]) == 2
