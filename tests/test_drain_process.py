"""The drain process (``RecordConfig.drain = "process"``, the default with the record ring).

It moves the ring's records to the journal from a process of its own: nothing of the recorder
runs in the program's interpreter between steps. These tests hold it to the recorder's promises:
every completed step is kept whatever dies when, a failure of the drain stops recording and
never the program, and a record that does not fit the ring is still written, in order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import torch

from replay import Recorder, RecorderConfig, open_recording
from replay.format import seal_part
from replay.format.journal import FrameKind, read_journal
from replay.record.drain import DrainProcess
from tests.test_crash import wait_until_not_live

RING_MIB = 1


def _step(rec: Recorder, s: int, *, big: bool = False) -> None:
    rec.begin_step()
    # 600 KiB is more than half of the 1 MiB ring: that step's record cannot be in the ring.
    rec.record_inputs(x=torch.full((600 * 256,) if big else (256,), float(s)), ids=torch.arange(8) + s)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(s))
    rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
    rec.end_step()


def _assert_steps(out: Path, n: int) -> None:
    rf = open_recording(out)["run-000"][0]
    assert [int(s) for s in rf.tables.steps["step"]] == list(range(n))
    for s in range(n):
        view = rf.step(s)
        assert float(view.inputs["x"][0]) == s and torch.equal(view.inputs["ids"], torch.arange(8) + s), s


def test_the_drain_process_writes_every_step_and_no_recorder_thread_runs(tmp_path):
    before = {t.name for t in threading.enumerate()}
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    assert isinstance(rec._writer, DrainProcess)
    ring = rec._rr.path
    for s in range(50):  # 50 steps of ~40 KiB wrap the 1 MiB ring
        _step(rec, s)
    assert {t.name for t in threading.enumerate()} == before, "no thread of the recorder in the program"
    assert rec.drain()
    steps = [f.body["step"] for f in read_journal(tmp_path / "r" / "run-000" / "rank-00000.journal").frames if f.kind == FrameKind.STEP]
    assert steps == list(range(50))
    rec.close()
    assert rec.error is None and not ring.exists()
    assert not rec._writer.alive()
    _assert_steps(tmp_path / "r", 50)


def test_a_record_larger_than_half_the_ring_is_written_by_the_program_in_order(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB, rng=False))
    for s in range(12):
        _step(rec, s, big=s in (3, 4, 9))
    rec.close()
    assert rec.error is None
    _assert_steps(tmp_path / "r", 12)
    rf = open_recording(tmp_path / "r")["run-000"][0]
    assert rf.step(4).inputs["x"].numel() == 600 * 256


def test_a_killed_drain_process_stops_recording_not_the_program(tmp_path, capsys):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    for s in range(5):
        _step(rec, s)
    os.kill(rec._writer._proc.pid, signal.SIGKILL)
    rec._writer._proc.wait(10)
    for s in range(5, 200):  # the program goes on; recording stops once the recorder notices
        _step(rec, s)
    rec.close()
    assert not rec.enabled and "drain process ended" in rec.error
    assert capsys.readouterr().err.count("recording stopped") == 1
    rf = open_recording(tmp_path / "r")["run-000"][0]
    n = rf.n_steps
    assert n >= 5, "the steps completed before the drain died are kept (moved from the ring at close)"
    _assert_steps(tmp_path / "r", n)
    assert not list((tmp_path / "r" / "run-000").glob("*.ring"))


def test_a_ctrl_c_for_the_program_does_not_stop_the_drain_process(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    _step(rec, 0)
    assert rec.drain()
    os.kill(rec._writer._proc.pid, signal.SIGINT)
    time.sleep(0.2)
    assert rec._writer.alive()
    for s in range(1, 4):
        _step(rec, s)
    rec.close()
    assert rec.error is None
    _assert_steps(tmp_path / "r", 4)


def _record_then_die(out: str, steps: int, stop_drain: bool, wfd: int) -> None:
    rec = Recorder(RecorderConfig(out=out, record_ring_mib=RING_MIB, keyframe_every=4), state_fn=lambda: {"kv": torch.ones(16)})
    pid = rec._writer._proc.pid
    if stop_drain:
        os.kill(pid, signal.SIGSTOP)  # the drain falls behind: the steps are only in the ring
    for s in range(steps):
        _step(rec, s)
    os.write(wfd, f"{pid}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def _run(out: Path, steps: int, stop_drain: bool) -> int:
    r, w = os.pipe()
    p = mp.get_context("fork").Process(target=_record_then_die, args=(str(out), steps, stop_drain, w), daemon=True)
    p.start()
    os.close(w)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    pid = int(os.read(r, 100).decode())
    os.close(r)
    return pid


def test_a_killed_rank_s_drain_process_writes_what_is_whole_then_ends(tmp_path):
    out = tmp_path / "r"
    _run(out, 30, stop_drain=False)
    wait_until_not_live(out / "run-000")
    sealed = seal_part(out / "run-000")
    assert len(sealed) == 1 and sealed[0].steps == 30 and not sealed[0].complete
    _assert_steps(out, 30)


def test_a_rank_and_its_drain_process_both_killed_lose_nothing(tmp_path):
    out = tmp_path / "r"
    pid = _run(out, 20, stop_drain=True)
    part = out / "run-000"
    journal_steps = [f for f in read_journal(part / "rank-00000.journal").frames if f.kind == FrameKind.STEP]
    assert journal_steps == [], "the stopped drain wrote nothing"
    os.kill(pid, signal.SIGKILL)
    wait_until_not_live(part)
    sealed = seal_part(part)
    assert len(sealed) == 1 and sealed[0].steps == 20
    _assert_steps(out, 20)
    rf = open_recording(out)["run-000"][0]
    kf_step, kf = rf.keyframe(19)
    assert torch.equal(kf["kv"], torch.ones(16))


def test_the_drain_process_writes_what_the_drain_thread_writes(tmp_path):
    tables = {}
    for drain in ("process", "thread"):
        rec = Recorder(RecorderConfig(out=tmp_path / drain, drain=drain, record_ring_mib=RING_MIB, rng=False))
        for s in range(10):
            _step(rec, s, big=s == 6)
        rec.close()
        assert rec.error is None
        tables[drain] = open_recording(tmp_path / drain)["run-000"][0].full()
    a, b = tables["process"], tables["thread"]
    assert a.steps.size == b.steps.size == 10
    for col in ("step", "status", "margin", "input_digest", "output_digest", "token_digest"):
        assert (a.steps[col] == b.steps[col]).all(), col
    assert a.fields.size == b.fields.size and (a.fields["digest"] == b.fields["digest"]).all()
    stored = lambda t: t.tensors[t.tensors["offset"] >= 0]  # noqa: E731
    assert (stored(a)["digest"] == stored(b)["digest"]).all() and (stored(a)["nbytes"] == stored(b)["nbytes"]).all()


def _forked_steps(rec: Recorder, wfd: int) -> None:
    for s in range(100, 200):  # a forked process that goes on calling its parent's recorder
        _step(rec, s)
    rec.close()
    os.write(wfd, f"{int(rec.enabled)}\n".encode())


def test_a_forked_process_never_writes_into_its_parent_s_recording(tmp_path):
    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    for s in range(3):
        _step(rec, s)
    assert rec.drain()
    r, w = os.pipe()
    p = mp.get_context("fork").Process(target=_forked_steps, args=(rec, w), daemon=True)
    p.start()
    os.close(w)
    p.join(60)
    assert p.exitcode == 0 and os.read(r, 10).decode().strip() == "0", "the fork's recording stopped"
    os.close(r)
    for s in range(3, 6):
        _step(rec, s)
    rec.close()
    assert rec.error is None and rec._writer.failed is False
    _assert_steps(tmp_path / "r", 6)


def test_a_drain_that_ends_right_after_doing_what_was_waited_for_is_not_a_failure() -> None:
    """The drain process ends once it has written the end marker. A wait that looked at the tail
    just before the drain moved it, and at the process just after it ended, called that a failure
    ("the drain process ended with code 0"), and a complete recording read as stopped early."""

    class _Ended:
        stderr = None

        def poll(self) -> int:
            return 0

    class _Ring:
        forked = False

    drain = DrainProcess.__new__(DrainProcess)
    drain.ring, drain._proc = _Ring(), _Ended()
    looks = iter([False, True])  # not yet when first looked at; done by the second look
    drain._wait(lambda: next(looks), timeout=5.0)  # must not raise


def test_the_drain_takes_the_wake_signal_and_is_not_ended_by_it(tmp_path):
    """The recording process cuts the drain's sleep short with a signal whose default action
    would end it: the drain blocks it in every thread (numpy's among them) before anything else
    runs, and says so in the ring's header only then."""
    from replay.format.ring_drain import WAKE_SIGNAL
    from replay.format.ring_salvage import H_WAKEABLE

    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    drain = rec._writer
    assert isinstance(drain, DrainProcess)
    _step(rec, 0)
    assert rec.drain()
    assert int(rec._rr.head_words[H_WAKEABLE]) == 1
    for s in range(1, 30):
        os.kill(drain._proc.pid, WAKE_SIGNAL)  # many, sent straight to the process (any thread takes it)
        drain.wake()
        _step(rec, s)
    assert drain.alive() and rec.drain()
    rec.close()
    assert rec.error is None
    _assert_steps(tmp_path / "r", 30)


def test_a_wait_for_the_drain_wakes_it_instead_of_waiting_out_its_sleep(tmp_path):
    """A drain that found the ring empty for a while sleeps up to POLL_MAX_S; whoever waits for it
    (a flush, the recorder's close, a full ring) wakes it, and does not wait out that sleep."""
    import statistics

    from replay.format.ring_drain import POLL_MAX_S

    rec = Recorder(RecorderConfig(out=tmp_path / "r", record_ring_mib=RING_MIB))
    waits = []
    for s in range(12):
        time.sleep(4 * POLL_MAX_S)  # the drain backs off to its longest sleep
        _step(rec, s)
        t0 = time.perf_counter()
        assert rec.drain()
        waits.append(time.perf_counter() - t0)
    rec.close()
    assert rec.error is None
    _assert_steps(tmp_path / "r", 12)
    assert statistics.median(waits) < 0.2 * POLL_MAX_S, waits


def test_the_drain_sleeps_longer_while_it_finds_little_and_shorter_when_the_ring_fills() -> None:
    from replay.format.ring_drain import POLL_MAX_S, POLL_MIN_S, next_poll

    cap = 64 << 20
    poll = POLL_MIN_S
    for _ in range(20):
        poll = next_poll(poll, 100_000, cap)  # a few small records a wake-up
    assert poll == POLL_MAX_S
    for _ in range(20):
        poll = next_poll(poll, cap // 4, cap)  # a quarter of the ring a wake-up
    assert poll == POLL_MIN_S
