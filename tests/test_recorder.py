"""The in-process recorder: exact bits back, keyframes, ring, collectives, and never hurting the program."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from replay import Recorder, RecorderConfig, open_recording
from replay.digest import digest
from replay.format import TensorKind

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.uint8, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_inputs_round_trip_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(3, 5, generator=g) * 100).to(dtype) for _ in range(4)]
    tensors.append(torch.randn(2, 3, 4, generator=g).to(dtype).transpose(0, 2))  # non-contiguous
    tensors.append(torch.zeros(0, 7).to(dtype))  # empty
    rec = Recorder(RecorderConfig(out=tmp_path / "r"))
    for t in tensors:
        rec.begin_step()
        rec.record_inputs(x=t, scalar=torch.tensor(3, dtype=torch.int32))
        rec.end_step()
    rec.close()
    assert rec.error is None
    with open_recording(tmp_path / "r") as r:
        rf = r["run-000"][0]
        assert rf.complete and rf.n_steps == len(tensors)
        for i, t in enumerate(tensors):
            back = rf.step(i).inputs["x"]
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))


def test_cpu_tensors_read_back_as_the_program_saw_them(tmp_path):
    """CPU tensors are copied into the ring by address only when their bytes are what they
    read: lazy conjugate and negated views, offsets into a storage, non-contiguous views and
    parameters still come back with the values the program saw."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 4, dtype=torch.complex64, generator=g)
    base = torch.randn(40, generator=g)
    cases = {
        "conj": z.conj(),  # conjugate bit set: the bytes hold z
        "neg": torch._neg_view(torch.randn(5, generator=g)),  # negative bit set
        "offset": base[7:19],  # contiguous, at an offset into its storage
        "strided": base[::3],
        "param": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        "bf16": torch.randn(6, generator=g).bfloat16(),
        "c128": torch.randn(2, 2, dtype=torch.complex128, generator=g),
    }
    rec = Recorder(RecorderConfig(out=tmp_path / "r"))
    rec.begin_step()
    rec.record_inputs(**cases)
    rec.end_step()
    rec.close()
    assert rec.error is None
    with open_recording(tmp_path / "r") as r:
        inputs = r["run-000"][0].step(0).inputs
        for name, t in cases.items():
            want = t.detach().resolve_conj().resolve_neg()
            assert inputs[name].dtype == want.dtype and torch.equal(inputs[name], want), name


def test_values_are_captured_at_record_time(tmp_path):
    """A static buffer reused by the program must be recorded as it was during the step."""
    buf = torch.zeros(4)
    rec = Recorder(RecorderConfig(out=tmp_path / "r", durability="async"))
    for s in range(5):
        buf.fill_(s)
        rec.begin_step()
        rec.record_inputs(buf=buf)
        rec.end_step()
    rec.close()
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert [float(rf.step(s).inputs["buf"][0]) for s in range(5)] == [0, 1, 2, 3, 4]


def test_keyframes_and_logits_ring(tmp_path):
    state = {"kv": torch.zeros(3), "ssm": torch.ones(2, dtype=torch.bfloat16)}
    rec = Recorder(RecorderConfig(out=tmp_path / "r", keyframe_every=4, ring=3), state_fn=lambda: state)
    logits = []
    for s in range(10):
        rec.begin_step()
        state["kv"] += 1
        lg = torch.randn(2, 16)
        logits.append(lg)
        rec.record_outputs(logits=lg)
        rec.end_step()
    rec.close()
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert rf.keyframe_steps() == [0, 4, 8]
    step, kf = rf.keyframe(7)
    assert step == 4 and torch.equal(kf["kv"], torch.full((3,), 4.0)) and kf["ssm"].dtype == torch.bfloat16
    t = rf.full()
    rows = t.tensors[t.tensors["kind"] == TensorKind.LOGITS]
    assert sorted(int(s) for s in rows["step"]) == [7, 8, 9]
    for row in rows:
        assert torch.equal(rf.read_tensor(row), logits[int(row["step"])])
    margins = t.steps["margin"]
    for s in range(10):
        top = logits[s].topk(2, dim=-1).values
        assert margins[s] == pytest.approx(float((top[:, 0] - top[:, 1]).min()))


def test_the_logits_ring_holds_fewer_steps_when_the_logits_are_large(tmp_path, monkeypatch):
    """The ring's copies stay in memory the program may need (the device's, for CUDA logits):
    past its byte bound it keeps fewer steps than ``ring``, the latest, and says so once."""
    from replay.record import recorder as recorder_mod

    monkeypatch.setattr(recorder_mod, "LOGITS_RING_BYTES", 300)  # two steps of 2x16 float32
    rec = Recorder(RecorderConfig(out=tmp_path / "r", ring=5))
    logits = []
    for _ in range(6):
        rec.begin_step()
        logits.append(torch.randn(2, 16))
        rec.record_outputs(logits=logits[-1])
        rec.end_step()
    rec.close()
    assert rec.error is None, rec.error
    rf = open_recording(tmp_path / "r")["run-000"][0]
    t = rf.full()
    rows = t.tensors[t.tensors["kind"] == TensorKind.LOGITS]
    assert sorted(int(s) for s in rows["step"]) == [4, 5]
    assert len([e for e in rf.tables.events if "logits ring keeps 2 of 5 steps" in e]) == 1, rf.tables.events


def test_collectives_and_graphs_tables(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", collectives="full"))
    gid = rec.record_graph("bs4", padded_size=4, kernels=[{"name": "gemm", "grid": [1, 2, 3], "block": [128, 1, 1]}])
    rec.record_tuner({"moe_combine": "blocked"})
    rec.begin_step()
    rec.record_graph_replay(gid)
    x = torch.arange(6.0)
    rec.record_collective("all_reduce", group="0", group_size=2, inputs=[x], outputs=[x * 2])
    rec.end_step()
    rec.close()
    rf = open_recording(tmp_path / "r")["run-000"][0]
    t = rf.full()
    assert t.graphs.size == 1 and t.string(int(t.graphs["key"][0])) == "bs4"
    assert t.string(int(t.kernels["name"][0])) == "gemm" and list(t.kernels["grid"][0]) == [1, 2, 3]
    assert rf.tuner_choices() == {"moe_combine": "blocked"}
    assert t.steps["mode"][0] == 2 and t.steps["n_collectives"][0] == 1
    c = t.collectives[0]
    assert t.string(int(c["op"])) == "all_reduce" and c["out_tensor"] >= 0
    assert torch.equal(rf.read_tensor(t.tensors[c["out_tensor"]]), x * 2)
    assert [f for f, _ in rf.step(0).fields()] == ["graph", "collective.0.all_reduce"]


def test_unwritable_directory_warns_once_and_program_goes_on(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    if os.access(ro, os.W_OK):  # root ignores permissions
        ro.chmod(0o700)
        (ro / "r").write_text("a file where the recording directory should be")
        out = ro / "r"
    else:
        out = ro / "r"
    rec = Recorder(RecorderConfig(out=out))
    x = torch.arange(4)
    for _ in range(3):
        rec.begin_step()
        rec.record_inputs(x=x)
        y = x * 2
        rec.record_outputs(y=y)
        rec.end_step()
    rec.close()
    assert not rec.enabled and rec.error
    assert torch.equal(y, torch.arange(4) * 2)
    assert capsys.readouterr().err.count("recording stopped") == 1


def test_size_limit_stops_recording_and_keeps_earlier_steps(tmp_path):
    if True:
        rec = Recorder(RecorderConfig(out=tmp_path / "r", max_bytes=40_000, rng=False))
        done = 0
        for s in range(50):
            rec.begin_step()
            rec.record_inputs(x=torch.full((1000,), s, dtype=torch.float32))
            rec.end_step()
            done += 1
        rec.close()
    assert done == 50 and not rec.enabled and "size limit" in rec.error
    rf = open_recording(tmp_path / "r")["run-000"][0]
    n = rf.n_steps
    assert 0 < n < 50
    for s in range(n):
        assert torch.equal(rf.step(s).inputs["x"], torch.full((1000,), s, dtype=torch.float32))


def test_writer_exception_does_not_reach_program(tmp_path, monkeypatch, capsys):
    # The drain thread's journal (the drain process's own failures: tests/test_drain_process.py).
    rec = Recorder(RecorderConfig(out=tmp_path / "r", drain="thread"))
    import replay.record.writer as w

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    rec.begin_step()
    rec.end_step()
    monkeypatch.setattr(rec._writer.journal, "write_frame", boom)
    for _ in range(3):
        rec.begin_step()
        rec.record_inputs(x=torch.ones(2))
        rec.end_step()
    rec.close()
    assert not rec.enabled and "Input/output error" in rec.error
    assert capsys.readouterr().err.count("recording stopped") == 1


def test_step_context_marks_raised_steps(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r"))
    with pytest.raises(ValueError):
        with rec.step():
            rec.record_inputs(x=torch.ones(1))
            raise ValueError("rank drift at step 0")
    rec.close()
    s = open_recording(tmp_path / "r")["run-000"][0].step(0)
    assert not s.ok and "rank drift" in s.reason


@pytest.mark.parametrize("rows", [
    [[1.0, 1.0, 0.0]],  # a tie: margin 0
    [[float("nan"), 1.0, 2.0]],  # NaN is the largest, as in topk
    [[1.0, float("nan"), float("nan")]],
    [[3.0, float("-inf")]],
    [[float("-inf"), float("-inf")]],
    [[float("inf"), float("inf"), 1.0]],
], ids=["tie", "nan", "two-nan", "neg-inf", "all-neg-inf", "two-inf"])
def test_the_sync_free_margin_equals_topk(rows) -> None:
    """issue 15: the device margin avoids topk (which waits for the device on CUDA) and must give
    topk's value, edge cases included; so must the host's (the drain's and salvage's, on the
    ring's bytes), which must also leave those bytes as they were."""
    import math

    from replay.format.ring_salvage import floats_at, margin_of
    from replay.format.schema import dtype_to_str
    from replay.record.margin import device_margin as _device_margin

    torch.manual_seed(0)
    for t in (torch.tensor(rows), torch.randn(8, 4, 1000), torch.randn(3, 7).half(), torch.randn(5, 33).bfloat16(),
              torch.randint(0, 3, (16, 9)).float()):
        top = t.float().topk(2, dim=-1).values
        want, got = float((top[..., 0] - top[..., 1]).min()), float(_device_margin(t))
        assert want == got or (math.isnan(want) and math.isnan(got)), (t, want, got)
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
        before = raw.copy()
        x = floats_at(raw, 0, dtype_to_str(t.dtype), list(t.shape))
        host = margin_of(x)
        assert want == host or (math.isnan(want) and math.isnan(host)), (t, want, host)
        assert np.array_equal(raw, before)
        if t.dtype == torch.float32:  # a float32 view of the bytes themselves: unchanged after
            view = raw.view(np.float32).reshape(t.shape)
            margin_of(view)
            assert np.array_equal(raw, before)


def test_side_plans_give_the_digests_and_margin_and_fall_back_when_a_capture_fails():
    """The side stream's plan (digests, then the margin's float32 bits, in one tail): equal to
    the reference digest and topk margin on every sighting; a capture that cannot be made (no
    CUDA here) turns plans off and the eager work goes on giving the same tail."""
    from replay.digest import digest, from_int64
    from replay.record.side_plan import CAPTURE_AFTER, SidePlans

    plans = SidePlans()
    logits = torch.randn(4, 3, 50)
    hidden = torch.randn(2, 1000)
    for step in range(CAPTURE_AFTER + 2):
        logits.normal_()
        hidden.normal_()
        tail = plans.run([logits, hidden], logits, static=True)
        assert [from_int64(int(v)) for v in tail[:2]] == [digest(logits), digest(hidden)], step
        top = logits.topk(2, dim=-1).values
        assert float(tail[2:].view(torch.float32)[0]) == float((top[..., 0] - top[..., 1]).min())
    assert plans.captured == 0 and not plans.enabled and plans.failure, "no CUDA graph on the CPU: plans off, with the reason"


def test_side_plans_capture_nothing_past_their_memory_cap(monkeypatch):
    """A captured plan keeps device memory for as long as it lives: past the cap a signature's
    work stays eager (here no capture is even tried, so plans stay on), and its results right."""
    from replay.digest import digest, from_int64
    from replay.record import side_plan

    monkeypatch.setattr(side_plan, "MAX_PLAN_BYTES", 1000)
    plans = side_plan.SidePlans()
    logits = torch.randn(4, 3, 50)  # 2400 bytes: twice that is over the cap
    for _ in range(side_plan.CAPTURE_AFTER + 2):
        logits.normal_()
        tail = plans.run([logits], logits, static=True)
        assert from_int64(int(tail[0])) == digest(logits)
    assert plans.enabled and plans.failure is None and plans.captured == 0 and plans.held_bytes == 0


def test_kept_buffers_serve_steps_in_and_out_of_inference_mode(tmp_path):
    """Buffers the recorder keeps from step to step (the side plan's tail, the record ring's
    tensor view) are made as normal tensors even when the first step runs under
    ``torch.inference_mode()``: a later step outside it writes them in place."""
    from replay.record.ring import ShmRing
    from replay.record.side_plan import SidePlans

    plans = SidePlans()
    x = torch.randn(4, 50)
    with torch.inference_mode():
        plans.run([x], x, static=True)
    plans.run([x], x, static=True)  # raised "Inplace update to inference tensor" before
    ring = ShmRing(str(tmp_path), 1 << 20, rank=0)
    try:
        with torch.inference_mode():
            ring.torch_data()
        ring.torch_data()[:8].copy_(torch.ones(8, dtype=torch.uint8))
        assert int(ring.data[:8].sum()) == 8
    finally:
        ring.close(unlink=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_reads_its_parent_s_cuda_generators(monkeypatch):
    """A process forked from one that used CUDA cannot use CUDA: its steps' RNG capture must not
    call the generator readers its parent found (on a GPU that stopped the child's recording
    with 'CUDA error: initialization error')."""
    from replay.core import rng

    def parent_reader() -> torch.Tensor:
        raise RuntimeError("CUDA error: initialization error")

    monkeypatch.setattr(rng, "_CUDA_READERS", (("cuda:0", parent_reader),))
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when the capture worked and read no CUDA state
        try:
            states = rng.capture_rng(host=False)
            os._exit(0 if set(states) == {"torch_cpu"} else 3)
        except BaseException:  # noqa: BLE001
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("outputs", ["digest", "full"])
def test_cpu_logits_a_probe_saw_are_recorded_as_returned(tmp_path, outputs):
    """CPU logits a probe saw (their margin taken then) and the step returned are recorded from
    one copy only while unchanged: logits changed in place after the probe, or other logits
    returned, are recorded as returned, and the margin stays the probe's."""
    g = torch.Generator().manual_seed(3)
    rec = Recorder(RecorderConfig(out=tmp_path / "r", outputs=outputs))
    seen, returned = [], []
    for s in range(4):
        lg = torch.randn(2, 3, 16, generator=g)
        rec.begin_step()
        rec.record_logits(lg)  # what a probe does with a ``logits`` argument
        seen.append(lg.clone())
        if s == 1:
            lg.mul_(-2.0)  # changed in place after the probe
        elif s == 2:
            lg = torch.randn(2, 3, 16, generator=g)  # other logits returned
        returned.append(lg.clone())
        rec.record_outputs(logits=lg, ids=lg.argmax(-1))
        rec.end_step()
    rec.close()
    assert rec.error is None
    with open_recording(tmp_path / "r") as r:
        rf = r["run-000"][0]
        margins = rf.full().steps["margin"]
        for s in range(4):
            step = rf.step(s)
            if outputs == "full":
                assert torch.equal(step.tensors(TensorKind.OUTPUT)["logits"], returned[s]), s
            assert step.digests(TensorKind.OUTPUT)["logits"] == digest(returned[s]), s
            assert step.digests(TensorKind.OUTPUT)["ids"] == digest(returned[s].argmax(-1)), s
            # (other logits returned are the step's last logits: their margin)
            top = (returned if s == 2 else seen)[s].topk(2, dim=-1).values
            assert margins[s] == pytest.approx(float((top[..., 0] - top[..., 1]).min())), s
