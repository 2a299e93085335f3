"""`replay info` and `replay verify` on synthetic recordings: the answers users rely on."""

from __future__ import annotations

import os
import shutil

import h5py
import pytest

from tests.factories import make_recording


@pytest.mark.parametrize(
    "field, expected_field",
    [("output", "output.logits"), ("tokens", "output.logits"), ("input", "input.input_ids")],
    ids=["logit-bits", "tokens", "input"],
)
def test_info_names_step_rank_and_field(tmp_path, run_cli, field, expected_field):
    rec = make_recording(tmp_path, ranks=4, steps=12, diverge_at=7, diverge_rank=2, field=field)
    res = run_cli("info", rec, "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["world_size"] == 4
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    assert all(r["steps"] == 12 and r["complete"] for r in data["ranks"])
    d = data["first_divergence"]
    assert (d["step"], d["ranks"], d["field"]) == (7, [2], expected_field)
    assert d["majority"] == [0, 1, 3]
    tok = data["first_token_divergence"]
    if field == "tokens":
        assert (tok["step"], tok["ranks"], tok["field"]) == (7, [2], "tokens.tokens")
        assert set(data["margin_at_token_divergence"]) == {"0", "1", "2", "3"}
    elif field == "output":
        assert tok is None


def test_info_text_names_the_divergence_and_next_command(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=3, steps=6, diverge_at=4, diverge_rank=1, field="tokens")
    res = run_cli("info", rec)
    assert res.code == 0
    assert "first divergence        step 4: output.logits differs on rank(s) 1" in res.out
    assert "first token divergence  step 4: tokens.tokens" in res.out
    # The recording is named: followed literally, the command re-runs this recording's step
    # (without it, the newest under recordings/, another one for a recording made with --out).
    assert f"next: replay step {rec} --rank 1 --step 4\n" in res.out + "\n"


def test_no_divergence(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=2, steps=5)
    data = run_cli("info", rec, "--json").json()
    assert data["first_divergence"] is None and data["first_token_divergence"] is None
    steps = data["ranks"][0]
    assert steps["graph_steps"] == 3 and steps["eager_steps"] == 2


def test_newest_recording_is_default(tmp_path, run_cli, monkeypatch):
    root = tmp_path / "recordings"
    make_recording(root, ranks=2, steps=3, name="20260101-000000-old")
    make_recording(root, ranks=2, steps=4, diverge_at=1, name="20260102-000000-new")
    monkeypatch.chdir(tmp_path)
    res = run_cli("info", "--json")
    assert res.code == 0
    assert res.json()["recording"].endswith("20260102-000000-new")
    assert "using the newest recording" in res.err


def test_no_recordings_at_all(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run_cli("info")
    assert res.code == 3
    assert res.err.count("\n") == 1 and "replay record" in res.err


def _one_line_error(res, code):
    assert res.code == code, (res.code, res.out, res.err)
    assert res.err.startswith("replay: error:") and res.err.count("\n") == 1, res.err
    assert "Traceback" not in res.err


@pytest.mark.parametrize("command", ["info", "verify"])
def test_truncated_rank_file(tmp_path, run_cli, command):
    rec = make_recording(tmp_path, ranks=2, steps=4)
    h5 = rec / "run-000" / "rank-00001.h5"
    data = h5.read_bytes()
    h5.write_bytes(data[: len(data) // 3])
    res = run_cli(command, rec)
    if command == "info":
        # What can be read is shown; the damaged file is named and the exit code says damaged.
        assert res.code == 4, (res.out, res.err)
        assert "rank 1: left out" in res.out and "rank-00001.h5" in res.out
        assert res.err.count("\n") == 1 and "rank 1 cannot be read" in res.err and "Traceback" not in res.err
    else:
        assert res.code == 4 and "DAMAGED" in res.out and "rank-00001.h5" in res.out


@pytest.mark.parametrize("command", ["info", "report", "verify"])
def test_a_payload_cut_short_after_sealing_is_damage(tmp_path, run_cli, command):
    """The payload file of a sealed rank shorter than its index declares (a copy cut short):
    ``info`` and ``report`` leave that rank out and exit 4, ``verify`` names the tensors lost."""
    rec = make_recording(tmp_path, ranks=2, steps=4)
    payload = rec / "run-000" / "rank-00001.payload"
    assert payload.stat().st_size > 100
    os.truncate(payload, 100)
    args = ["-o", tmp_path / "r.html"] if command == "report" else []
    res = run_cli(command, rec, *args)
    assert res.code == 4, (res.out, res.err)
    assert "Traceback" not in res.err
    if command == "verify":
        assert "DAMAGED" in res.out and "file truncated" in res.out
    else:
        assert res.err.count("\n") == 1 and "rank 1 cannot be read" in res.err
    if command == "info":
        assert "rank 1: left out" in res.out and "is truncated (100 of the" in res.out


def test_info_and_report_go_on_past_an_unreadable_rank(tmp_path, run_cli):
    """One damaged rank file out of four (cut short in transit) does not hide the divergence the
    other three recorded; the file is named, and the exit code still says damaged."""
    rec = make_recording(tmp_path, ranks=4, steps=8, diverge_at=5, diverge_rank=2, field="tokens")
    (rec / "run-000" / "rank-00000.h5").write_bytes(b"\0" * 4096)
    res = run_cli("info", rec, "--json")
    assert res.code == 4, res.err
    data = res.json()
    assert [r["rank"] for r in data["ranks"]] == [1, 2, 3]
    assert [u["rank"] for u in data["unreadable_ranks"]] == [0]
    assert "rank-00000.h5" in data["unreadable_ranks"][0]["problem"]
    assert data["missing_ranks"] == [] and data["world_size"] == 4
    d = data["first_divergence"]
    assert (d["step"], d["ranks"], d["majority"]) == (5, [2], [1, 3])
    rep = run_cli("report", rec, "--json", "-o", tmp_path / "r.html")
    assert rep.code == 4, rep.err
    page = rep.json()
    assert page["first_token_divergence"]["step"] == 5 and page["agreement"]["ranks"] == [1, 2, 3]
    assert "Rank 0 is left out" in (tmp_path / "r.html").read_text()
    # Every rank file damaged: nothing to show, one line.
    for r in (1, 2, 3):
        (rec / "run-000" / f"rank-0000{r}.h5").write_bytes(b"\0" * 4096)
    _one_line_error(run_cli("info", rec), 4)


@pytest.mark.parametrize("command", ["info", "verify"])
def test_not_hdf5(tmp_path, run_cli, command):
    rec = make_recording(tmp_path, ranks=2, steps=2)
    (rec / "run-000" / "rank-00000.h5").write_bytes(b"this is not hdf5" * 100)
    res = run_cli(command, rec)
    assert res.code == 4
    assert "not an HDF5 file" in res.out


@pytest.mark.parametrize("where", ["rank-file", "manifest"])
@pytest.mark.parametrize("command", ["info", "verify"])
def test_newer_format_version(tmp_path, run_cli, command, where):
    rec = make_recording(tmp_path, ranks=2, steps=2)
    if where == "rank-file":
        with h5py.File(rec / "run-000" / "rank-00000.h5", "r+") as f:
            f.attrs["format_version"] = 99
    else:
        import json

        m = json.loads((rec / "manifest.json").read_text())
        m["format_version"] = 99
        (rec / "manifest.json").write_text(json.dumps(m))
    res = run_cli(command, rec)
    if command == "info" or where == "manifest":
        _one_line_error(res, 5)
    else:
        assert res.code == 4
    assert "version 99" in (res.err + res.out) and "upgrade replay" in (res.err + res.out)


def test_path_that_is_not_a_recording(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    _one_line_error(run_cli("info", tmp_path / "empty"), 4)
    (tmp_path / "afile").write_text("x")
    _one_line_error(run_cli("info", tmp_path / "afile"), 4)
    _one_line_error(run_cli("verify", tmp_path / "nope"), 3)


def test_verify_detects_flipped_payload_byte(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=1, steps=3)
    assert run_cli("verify", rec).code == 0
    payload = rec / "run-000" / "rank-00000.payload"
    raw = bytearray(payload.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    payload.write_bytes(bytes(raw))
    res = run_cli("verify", rec, "--json")
    assert res.code == 4
    problems = res.json()["ranks"][0]["problems"]
    assert any("do not match their digest" in p for p in problems)


def test_verify_reports_missing_rank(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=3, steps=2)
    for f in (rec / "run-000").glob("rank-00001.*"):
        f.unlink()
    res = run_cli("verify", rec)
    assert res.code == 4 and "no file for rank 1 of 3" in res.out


def test_info_reads_unsealed_journal(tmp_path, run_cli):
    """A rank that never closed (crash) is read from its journal and reported incomplete."""
    from replay import Recorder, RecorderConfig
    import torch

    out = tmp_path / "rec"
    rec = Recorder(RecorderConfig(out=out, rank=0, world_size=1))
    for s in range(3):
        rec.begin_step()
        rec.record_inputs(x=torch.arange(3) + s)
        rec.end_step()
    # Simulate a crash: the writer's files are left as they are and the lock released.
    rec._writer.stop(5)
    rec._writer.journal.close()
    rec._release_lock()
    data = run_cli("info", out, "--json").json()
    assert data["ranks"][0]["steps"] == 3 and data["ranks"][0]["complete"] is False
    res = run_cli("verify", out)
    assert res.code == 4 and "ended without its end marker" in res.out and "after step 2" in res.out
    rec._closed = True


def test_extra_collective_on_one_rank_is_found(tmp_path, run_cli):
    """Ranks whose field rows do not line up (one made an extra collective) are still compared."""
    import torch

    from replay import Recorder, RecorderConfig

    out = tmp_path / "rec"
    for r in range(3):
        rec = Recorder(RecorderConfig(out=out, rank=r, world_size=3, rng=False))
        for s in range(6):
            rec.begin_step()
            rec.record_inputs(x=torch.arange(4) + s)
            if r == 1 and s == 4:
                rec.record_collective("broadcast", group_size=3, inputs=[torch.ones(2)], outputs=[torch.ones(2)])
            rec.record_collective("all_reduce", group_size=3, inputs=[torch.ones(2) * r], outputs=[torch.ones(2) * 3])
            rec.record_outputs(logits=torch.ones(2, 4) * s)
            rec.end_step()
        rec.close()
    d = run_cli("info", out, "--json").json()["first_divergence"]
    assert d["step"] == 4 and d["ranks"] == [1] and d["field"].startswith("collective.0.")


def test_rank_that_stopped_early_is_not_a_divergence(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=3, steps=8)
    # Rank 2 recorded only 5 steps (as if it had crashed): drop its later steps.
    import torch

    from replay import Recorder, RecorderConfig

    for f in (rec / "run-000").glob("rank-00002.*"):
        f.unlink()
    r2 = Recorder(RecorderConfig(out=rec, rank=2, world_size=3))
    from tests.factories import step_inputs, step_logits

    for s in range(5):
        r2.begin_step()
        r2.record_inputs(**step_inputs(s))
        lg = step_logits(s)
        r2.record_outputs(logits=lg, tokens=lg.argmax(-1), accepted=torch.ones(4, dtype=torch.int64))
        r2.set_run("graph" if s % 2 == 0 else "eager", key="bs4", padded_size=4, reason="" if s % 2 == 0 else "test")
        r2.end_step()
    r2.close()
    data = run_cli("info", rec, "--json").json()
    assert data["first_divergence"] is None
    assert [r["steps"] for r in data["ranks"]] == [8, 8, 5]


def _streams_recording(tmp_path, *, diverge_rank: int, diverge_step: int):
    """Two ranks, a target and a draft stream in one loop (T D D T D D ...); from
    ``diverge_step`` on, ``diverge_rank``'s outputs differ."""
    import torch

    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    out = tmp_path / "rec"
    order = ["target", "draft", "draft"] * 4
    for r in range(2):
        rec = Recorder(RecorderConfig(out=out, part="run-000", rank=r, world_size=2))
        rec.set_target({"step": "m:M", "stream": "target", "streams": {"target": {}, "draft": {}}})
        for s, name in enumerate(order):
            rec.begin_step()
            rec.record_inputs(x=torch.full((2,), float(s)))
            rec.record_args(__stream__=name)
            y = torch.full((3,), float(s))
            if r == diverge_rank and s >= diverge_step:
                y[0] += 1
            rec.record_outputs(logits=y)
            rec.end_step()
        rec.close()
    return out


def test_info_labels_divergences_with_their_stream_and_counts_steps_per_stream(tmp_path, run_cli):
    rec = _streams_recording(tmp_path, diverge_rank=1, diverge_step=5)
    data = run_cli("info", rec, "--json").json()
    d = data["first_divergence"]
    assert (d["step"], d["stream"], d["stream_step"], d["field"]) == (5, "draft", 3, "output.logits")
    streams = {s["stream"]: s for s in data["streams"]}
    assert [s["stream"] for s in data["streams"]] == ["target", "draft"]  # in order of first appearance
    assert (streams["target"]["steps"], streams["draft"]["steps"]) == (4, 8)
    assert (streams["target"]["first_step"], streams["draft"]["first_step"], streams["draft"]["last_step"]) == (0, 1, 11)
    # Each stream's own first divergence: the target's is its step 2 (step 6 of the part).
    td = streams["target"]["first_divergence"]
    assert (td["step"], td["stream_step"]) == (6, 2)
    assert streams["draft"]["first_divergence"]["step"] == 5
    text = run_cli("info", rec).out
    assert "first divergence        step 5 (stream draft, its step 3): output.logits differs on rank(s)" in text
    assert "streams     2 models in one loop" in text


def test_info_of_one_stream_has_no_stream_labels(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=2, steps=4, diverge_at=2, diverge_rank=1)
    data = run_cli("info", rec, "--json").json()
    assert data["streams"] == [] and "stream" not in data["first_divergence"]
    assert "streams " not in run_cli("info", rec).out


def test_the_stream_argument_is_spelled_as_the_recorder_writes_it():
    from replay import numerics
    from replay.analysis import streams

    assert streams.STREAM_ARG == numerics.STREAM_ARG


def test_ranks_that_share_no_step_are_never_no_divergence():
    """Two ranks of which one recorded no step: nothing was compared, so no 'no divergence'."""
    from replay.analysis.summary import verdict_line

    ranks = [{"rank": 0, "steps": 5}, {"rank": 1, "steps": 0}]
    s = {"first_divergence": None, "first_token_divergence": None, "ranks": ranks, "unreadable_ranks": []}
    assert verdict_line(s).startswith("nothing compared")
    assert "no divergence" not in verdict_line(s)
    s = {**s, "ranks": [{"rank": 0, "steps": 5}, {"rank": 1, "steps": 5}]}
    assert verdict_line(s).startswith("no divergence: 2 ranks")


def test_no_token_divergence_is_said_only_when_tokens_were_recorded():
    """Ranks that differ in bits with no token field recorded: what they sampled was never
    compared, so the verdict says so instead of "no token divergence"."""
    from replay.analysis.summary import verdict_line

    first = {"step": 3, "field": "output.logits", "ranks": [1], "majority": [0]}
    s = {"first_divergence": first, "first_token_divergence": None, "ranks": [{"rank": 0, "steps": 5}, {"rank": 1, "steps": 5}],
         "unreadable_ranks": [], "token_fields": False}
    assert verdict_line(s).endswith("; no token field recorded to compare")
    assert verdict_line({**s, "token_fields": True}).endswith("; no token divergence")


def test_a_divergence_says_when_no_group_of_ranks_is_a_majority() -> None:
    """Three ranks that all differ, or four split two against two, have no majority: the ranks
    named odd are named by rule, and the line says so instead of "majority: 0"."""
    from replay.analysis.divergence import Divergence

    three = Divergence(step=2, field="output.logits", ranks=[1, 2], majority=[0], digests={0: 5, 1: 6, 2: 7})
    assert "no majority: 3 different values among 3 ranks" in three.what(), three.what()
    even = Divergence(step=2, field="output.logits", ranks=[1, 3], majority=[0, 2], digests={0: 5, 1: 6, 2: 5, 3: 6})
    assert "no majority: ranks 0, 2 and 1, 3 split evenly" in even.what(), even.what()
    real = Divergence(step=2, field="output.logits", ranks=[1], majority=[0, 2, 3], digests={0: 5, 1: 6, 2: 5, 3: 5})
    assert real.what().endswith("(majority: 0, 2, 3)") and real.to_json()["majority_strict"], real.what()
    assert not even.to_json()["majority_strict"]


def _reduced_recording(out, *, input_of, args_of=None):  # noqa: ANN001, ANN202
    """Two ranks that all_reduce a tensor each step and record the (equal) reduced result and
    tokens; ``input_of(rank, step)`` is what each rank reduces, ``args_of(rank)`` its arguments."""
    import torch

    from replay import Recorder, RecorderConfig

    for r in range(2):
        rec = Recorder(RecorderConfig(out=out, rank=r, world_size=2, rng=False))
        for s in range(8):
            rec.begin_step()
            rec.record_inputs(x=torch.arange(4) + s)
            if args_of is not None:
                rec.record_args(**args_of(r))
            rec.record_collective("all_reduce", group_size=2, inputs=[input_of(r, s)], outputs=[torch.ones(4) * s])
            rec.record_outputs(logits=torch.ones(2, 4) * s, tokens=torch.full((2,), s))
            rec.end_step()
        rec.close()
    return out


def test_a_drift_that_a_collective_hides_is_a_divergence(tmp_path, run_cli):
    """Rank 1's logits drifted before the all_reduce at step 5 only: every rank received the same
    sum and every field agrees, and info said "no divergence: 2 ranks recorded the same bits at
    every common step" (so did bisect steps). The collective's input, which agrees at the other
    steps, differs there: that is the first divergence."""
    import torch

    out = _reduced_recording(tmp_path / "rec", input_of=lambda r, s: torch.ones(4) * s + (1e-3 if (r, s) == (1, 5) else 0))
    res = run_cli("info", out)
    assert res.code == 0, res.err
    assert res.out.startswith("first divergence at step 5: the input of collective.0.all_reduce differs on rank(s) 1"), res.out
    assert "no divergence" not in res.out
    d = run_cli("info", out, "--json").json()["first_divergence"]
    assert (d["step"], d["field"], d["ranks"]) == (5, "collective.0.all_reduce input", [1])
    b = run_cli("bisect", "steps", out, "--no-save", "--json").json()
    assert b["first"] == 5 and b["field"] == "collective.0.all_reduce input", b


def test_shards_reduced_by_a_collective_are_no_divergence(tmp_path, run_cli):
    """Tensor-parallel partial sums differ at every step by design: no divergence, even where
    they happen to agree once."""
    import torch

    out = _reduced_recording(tmp_path / "rec", input_of=lambda r, s: torch.ones(4) * (r if s != 3 else 0))
    d = run_cli("info", out, "--json").json()
    assert d["first_divergence"] is None, d["first_divergence"]


def test_verify_says_when_the_manifest_is_missing(tmp_path, run_cli):
    """A recording handed over without its manifest.json (and signature): verify said "intact"
    and nothing else; it says the rank files are intact and what the missing manifest held."""
    rec = make_recording(tmp_path, ranks=1, steps=3)
    res = run_cli("verify", rec, "--json")
    assert res.code == 0 and res.json()["notes"] == [], res.out
    (rec / "manifest.json").unlink()
    res = run_cli("verify", rec)
    assert res.code == 0 and "note: no manifest.json: the command, the versions" in res.out, res.out


def test_a_rank_argument_is_not_named_as_a_difference_at_the_divergence(tmp_path, run_cli):
    """The step takes the rank's own number (`decode_step(model, tok, step, rank)`): info said
    "rank 1 called step 5 with other arguments than rank 0: rank 1 (rank 0: 0)", a difference by
    design; an argument that really differs (a temperature) is still named."""
    import torch

    drift = lambda r, s: torch.ones(4) * s + (1e-3 if (r, s) == (1, 5) else 0)  # noqa: E731
    out = _reduced_recording(tmp_path / "rec", input_of=drift, args_of=lambda r: {"rank": r})
    res = run_cli("info", out)
    assert "with other arguments" not in res.out, res.out
    out = _reduced_recording(tmp_path / "rec2", input_of=drift, args_of=lambda r: {"rank": r, "temp": 0.5 + r})
    res = run_cli("info", out)
    assert "rank 1 called step 5 with other arguments than rank 0" in res.out and "temp 1.5 (rank 0: 0.5)" in res.out, res.out
    assert "rank 1 (rank 0: 0)" not in res.out, res.out
