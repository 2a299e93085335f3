"""The record ring: a step is durable when ``end_step`` returns, whatever the drain is doing.

The drain is stalled on purpose (its write sleeps) so that the steps can only survive through the
ring: a SIGKILL then seal must give them all back, bit for bit, also after the ring wrapped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from replay import Recorder, RecorderConfig, open_recording
from replay.digest import digest
from replay.format import seal_part
from replay.format.journal import FrameKind, read_journal

RING_MIB = 1  # the smallest ring: a few dozen steps of these sizes wrap it
RING = RING_MIB << 20


def _inputs(s: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    return {"ids": torch.randint(0, 1000, (64,), generator=g), "x": torch.randn(48, 256, generator=g)}


def _logits(s: int) -> torch.Tensor:
    return torch.randn(4, 512, generator=torch.Generator().manual_seed(10_000 + s))


def _stall_drain_from(step: int) -> None:
    import replay.record.writer as w

    orig = w.Writer._write

    def write(self, job):  # noqa: ANN001, ANN202
        if job.kind == FrameKind.STEP and job.body.get("step", 0) >= step:
            time.sleep(3600)
        return orig(self, job)

    w.Writer._write = write


def _child(out: str, steps: int, stall_from: int, wfd: int) -> None:
    _stall_drain_from(stall_from)
    state = {"kv": torch.zeros(32)}
    # A stalled drain thread (a stalled drain process: tests/test_drain_process.py).
    rec = Recorder(RecorderConfig(out=out, keyframe_every=5, ring=2, record_ring_mib=RING_MIB, drain="thread"), state_fn=lambda: state)
    for s in range(steps):
        rec.begin_step()
        rec.record_inputs(**_inputs(s))
        lg = _logits(s)
        state["kv"] += 1
        rec.record_outputs(logits=lg, tokens=lg.argmax(-1))
        rec.record_args(temperature=0.5, step_no=s)
        rec.end_step()
    os.write(wfd, f"{rec.ring_stats()['full_waits']}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def _run_child(out: Path, steps: int, stall_from: int) -> int:
    r, w = os.pipe()
    p = mp.get_context("fork").Process(target=_child, args=(str(out), steps, stall_from, w), daemon=True)
    p.start()
    os.close(w)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    data = os.read(r, 100)
    os.close(r)
    return int(data.decode().strip())


@pytest.mark.parametrize("steps,stall_from", [(6, 0), (40, 30)], ids=["no-drain", "wrapped"])
def test_sigkill_with_the_drain_stalled_loses_nothing(tmp_path, steps, stall_from):
    out = tmp_path / "rec"
    _run_child(out, steps, stall_from)
    part = out / "run-000"
    journal_steps = [f.body["step"] for f in read_journal(part / "rank-00000.journal").frames if f.kind == FrameKind.STEP]
    # The drain wrote some steps before its stall (not always all of them: it runs at its own pace).
    assert journal_steps == list(range(len(journal_steps))) and len(journal_steps) <= stall_from
    ring_file = Path((part / "rank-00000.ring").read_text().strip())
    assert ring_file.exists(), "the ring outlives the killed process"
    sealed = seal_part(part)
    assert len(sealed) == 1 and sealed[0].steps == steps and not sealed[0].complete
    assert not ring_file.exists() and not (part / "rank-00000.ring").exists()
    rf = open_recording(out)["run-000"][0]
    assert list(rf.tables.steps["step"]) == list(range(steps))
    for s in range(steps):
        view = rf.step(s)
        for name, t in _inputs(s).items():
            assert torch.equal(view.inputs[name], t), (s, name)
        lg = _logits(s)
        fields = dict(view.fields())
        assert fields["output.logits"] == digest(lg)
        top = lg.topk(2, dim=-1).values
        assert float(view.margin) == float((top[..., 0] - top[..., 1]).min())
        assert torch.equal(view.tensors(__import__("replay.format", fromlist=["TensorKind"]).TensorKind.TOKENS)["tokens"], lg.argmax(-1))
    kf_step, kf = rf.keyframe(steps - 1)
    assert torch.equal(kf["kv"], torch.full((32,), float(kf_step)))


class _Gate:
    """Holds every drain back until ``set``: a drain thread waits in its write, a drain process
    is stopped (SIGSTOP) as soon as it starts."""

    def __init__(self) -> None:
        import threading

        self.opened = threading.Event()
        self.stopped: list[int] = []

    def set(self) -> None:
        self.opened.set()
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.fixture
def gate(monkeypatch):
    """The drain writes nothing until the test opens the gate."""
    import replay.record.drain as d
    import replay.record.writer as w

    g = _Gate()
    orig = w.Writer._write

    def write(self, job):  # noqa: ANN001, ANN202
        g.opened.wait(60)
        return orig(self, job)

    orig_init = d.DrainProcess.__init__

    def init(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        orig_init(self, *a, **k)
        if not g.opened.is_set():
            os.kill(self._proc.pid, signal.SIGSTOP)
            g.stopped.append(self._proc.pid)

    monkeypatch.setattr(w.Writer, "_write", write)
    monkeypatch.setattr(d.DrainProcess, "__init__", init)
    yield g
    g.set()


def _record_big_steps(out: Path, policy: str, steps: int = 40) -> Recorder:
    rec = Recorder(RecorderConfig(out=out, rng=False, record_ring_mib=RING_MIB, ring_full=policy, inputs="full"))
    for s in range(steps):
        rec.begin_step()
        rec.record_inputs(x=torch.full((64, 1024), float(s)))  # 256 KiB a step: 4 fill the ring
        rec.end_step()
    return rec


def test_full_ring_blocks_and_keeps_every_step(tmp_path, gate):
    import threading

    threading.Timer(0.3, gate.set).start()  # the drain comes back after 0.3 s
    rec = _record_big_steps(tmp_path / "r", "block")
    stats = rec.ring_stats()
    rec.close()
    assert rec.error is None
    assert stats["full_waits"] > 0 and stats["full_wait_s"] > 0.05 and stats["dropped_steps"] == 0
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert rf.n_steps == 40
    assert all(float(rf.step(s).inputs["x"][0, 0]) == s for s in range(40))
    assert any("waits for room" in e for e in rf.tables.events)


def test_full_ring_drop_records_the_gap(tmp_path, gate):
    rec = _record_big_steps(tmp_path / "r", "drop")
    stats = rec.ring_stats()
    gate.set()
    rec.close()
    assert rec.error is None
    assert stats["full_waits"] == 0, "drop never waits"
    # 1 MiB holds three 256 KiB steps (each with its header): the rest found no room.
    assert stats["dropped_steps"] == 37
    rf = open_recording(tmp_path / "r")["run-000"][0]
    kept = [int(s) for s in rf.tables.steps["step"]]
    assert kept == [0, 1, 2]
    for s in kept:
        assert float(rf.step(s).inputs["x"][0, 0]) == s
    assert stats["dropped"] == list(range(3, 40))
    notes = [e for e in rf.tables.events if "not recorded: the record ring was full" in e]
    assert len(notes) == 37
    # `replay info` shows the ring's figures from the end marker (issue 15).
    from replay import api
    from replay.cli.info_text import render_info

    with open_recording(tmp_path / "r") as recording:
        result = api.info(recording)
    ring = result.to_json()["ranks"][0]["record_ring"]
    assert ring == {"bytes": RING, "policy": "drop", "full_waits": 0, "full_wait_s": 0.0, "dropped_steps": 37}
    assert "record ring (1 MiB, policy drop) full 0 times, 0.000 s waited, 37 steps dropped" in render_info(result)


def test_clean_close_removes_the_ring(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    ring = rec.ring_stats()
    assert ring["enabled"] and ring["bytes"] == RING
    path = rec._rr.path
    rec.begin_step()
    rec.record_inputs(x=torch.ones(3))
    rec.end_step()
    rec.close()
    assert not path.exists() and not (tmp_path / "r" / "run-000" / "rank-00000.ring").exists()
    assert rec.ring_stats()["enabled"], "what the ring did stays readable after close"


def test_salvage_never_touches_a_file_the_pointer_names_outside_its_pattern(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=0))  # no ring: a plain journal
    rec.begin_step()
    rec.end_step()
    part = tmp_path / "r" / "run-000"
    rec._writer.stop(5)  # leave the journal unsealed, as a killed rank does
    rec._release_lock()
    rec._closed = True
    (part / "rank-00000.ring").write_text(str(victim) + "\n")
    sealed = seal_part(part)
    assert len(sealed) == 1 and sealed[0].steps == 1
    assert victim.read_text() == "keep me"


def test_no_ring_dir_falls_back_to_the_writer_with_a_note(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_dir=str(tmp_path / "missing")))
    assert not rec.ring_stats()["enabled"]
    rec.begin_step()
    rec.record_inputs(x=torch.ones(3))
    rec.end_step()
    rec.close()
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert rf.n_steps == 1 and any("no record ring" in e for e in rf.tables.events)


def _record_rich(out: str, steps: int, kill: bool) -> None:
    """Every kind of record: collectives in and outside a step, graphs, replays, tuner, args."""
    if kill:
        _stall_drain_from(0)
    # Salvaged: the drain thread stalls from the first job; drained: the drain process writes all.
    rec = Recorder(RecorderConfig(out=out, record_ring_mib=RING_MIB, collectives="full", ring=2, drain="thread" if kill else "process"))
    rec.record_graph("bucket=4", padded_size=4, kernels=[{"name": "mm", "grid": [1, 1, 1], "block": [32, 1, 1]}], source="toy")
    rec.record_collective("broadcast", group="g", group_size=2, inputs=(torch.arange(4),), outputs=(torch.arange(4),))
    for s in range(steps):
        rec.begin_step()
        rec.record_inputs(**_inputs(s))
        rec.record_args(temperature=0.25, n=s)
        x = torch.full((16,), float(s))
        rec.record_collective("all_reduce", group="g", group_size=2, inputs=(x,), outputs=(x * 2,))
        rec.record_graph_replay(0)
        lg = _logits(s)
        rec.record_outputs(logits=lg, tokens=lg.argmax(-1), accepted=torch.tensor([1 + s % 3, 2]))
        rec.record_tuner({"moe": f"t{s % 2}"})
        rec.end_step()
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    rec.close()


def test_salvaged_steps_equal_drained_steps(tmp_path):
    """What salvage rebuilds from the ring is what the drain (process) wrote."""
    ctx = mp.get_context("fork")
    for name, kill in (("drained", False), ("salvaged", True)):
        p = ctx.Process(target=_record_rich, args=(str(tmp_path / name), 8, kill))
        p.start()
        p.join(60)
        assert p.exitcode == (-signal.SIGKILL if kill else 0)
    seal_part(tmp_path / "salvaged" / "run-000")
    a = open_recording(tmp_path / "drained")["run-000"][0].full()
    b = open_recording(tmp_path / "salvaged")["run-000"][0].full()
    assert a.steps.size == b.steps.size == 8
    for col in ("step", "status", "mode", "graph", "margin", "accepted", "n_collectives", "input_digest", "output_digest", "token_digest"):
        # (not rng_digest: a forked child reseeds Python's and numpy's generators)
        assert (a.steps[col] == b.steps[col]).all(), col
    assert [a.string(int(i)) for i in a.steps["args"]] == [b.string(int(i)) for i in b.steps["args"]]
    fa, fb = a.fields[~np.isin(a.fields["field"], _rng_ids(a))], b.fields[~np.isin(b.fields["field"], _rng_ids(b))]
    assert fa.size == fb.size and (fa["digest"] == fb["digest"]).all() and (fa["step"] == fb["step"]).all()
    for table, cols in ( ("collectives", ("step", "ordinal", "in_digest", "out_digest", "compare")),
                        ("replays", ("step", "graph")), ("graphs", ("graph", "padded_size", "n_kernels"))):
        ta, tb = getattr(a, table), getattr(b, table)
        assert ta.size == tb.size > 0, table
        for col in cols:
            assert (ta[col] == tb[col]).all(), (table, col)
    # Not RNG states (reseeded) nor the logits ring, which is written at exit only.
    sa = a.tensors[(a.tensors["offset"] >= 0) & ~np.isin(a.tensors["kind"], (4, 6))]
    sb = b.tensors[(b.tensors["offset"] >= 0) & ~np.isin(b.tensors["kind"], (4, 6))]
    assert sa.size == sb.size > 0
    assert (sa["digest"] == sb["digest"]).all() and (sa["nbytes"] == sb["nbytes"]).all()


def _rng_ids(t) -> list[int]:  # noqa: ANN001
    return [i for i in range(len(t.strings)) if t.strings[i].startswith("rng.")]


def test_live_ring_steps_are_readable_while_the_drain_is_behind(tmp_path, gate):
    from replay.format.ring_salvage import live_ring_steps

    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    for s in range(3):
        rec.begin_step()
        rec.record_inputs(x=torch.ones(3) * s)
        rec.end_step()
    journal = tmp_path / "r" / "run-000" / "rank-00000.journal"
    assert live_ring_steps(journal) == [0, 1, 2]  # none drained yet, all durable in the ring
    gate.set()
    rec.close()
    assert live_ring_steps(journal) == []


def test_drain_waits_until_the_journal_holds_every_step(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    for s in range(5):
        rec.begin_step()
        rec.record_inputs(x=torch.ones(3) * s)
        rec.end_step()
    assert rec.drain()
    steps = [f.body["step"] for f in read_journal(tmp_path / "r" / "run-000" / "rank-00000.journal").frames if f.kind == FrameKind.STEP]
    assert steps == [0, 1, 2, 3, 4]
    rec.close()
