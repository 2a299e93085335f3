"""``replay diff A B``: verdicts, first differences, layouts, batching, tolerance, exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from replay import Recorder, RecorderConfig
from replay.analysis.diff import DiffOptions, DiffVerdict, diff
from tests.factories import make_recording, step_inputs, step_logits

# -- recordings built for these tests ---------------------------------------------------------

WEIGHT = "layers.1.attention.wo.weight"


def _weights(changed: bool) -> dict:
    w = torch.zeros(8, 8)
    if changed:
        w[3, 5] += 1e-2
    from replay.digest import digest, format_digest

    return {
        "layers.0.attention.wo.weight": {"digest": format_digest(digest(torch.ones(8, 8))), "shape": [8, 8], "dtype": "float32"},
        WEIGHT: {"digest": format_digest(digest(w)), "shape": [8, 8], "dtype": "float32"},
    }


def _hidden(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(4, 8, generator=g)  # hidden: [B, D], D sharded over the TP ranks


def record_run(
    out: Path,
    *,
    tp: int = 1,
    steps: int = 5,
    outputs: str = "full",
    placements: bool = True,
    weights: dict | None = None,
    bump_hidden_at: int | None = None,
    scale_logits: float = 1.0,
    target_extra: dict | None = None,
    batch: int = 4,
    request_order: list[int] | None = None,
    mode: str = "eager",
    numerics: list[str] | None = None,
    scale_gather: float = 1.0,
) -> Path:
    """A decode loop at tensor-parallel degree ``tp``: logits and tokens replicated on every rank,
    ``hidden`` split along dim 1 in rank order (recorded with its layout when ``placements``)."""
    for r in range(tp):
        target: dict = {"factory": "tests.toy:build", "config": {"layers": 2, "tp": tp}}
        if placements and tp > 1:
            target["layout"] = {"fields": {"output.hidden": {"placements": ["Shard(1)"]}}}
        if weights is not None:
            target["weights"] = weights(r) if callable(weights) else weights  # a callable: each rank's own
        target.update(target_extra or {})
        rec = Recorder(RecorderConfig(out=out, rank=r, world_size=tp, outputs=outputs))
        rec.set_target(target)
        for s in range(steps):
            rec.begin_step()
            if numerics is not None:
                rec.record_args(**{"__numerics__": numerics[s]})
            inputs = step_inputs(s, batch)
            if request_order is not None:
                inputs["request_ids"] = torch.tensor(request_order[:batch])
            rec.record_inputs(**inputs)
            if tp > 1:  # the all-gather of a TP run: a field a TP=1 run does not have
                rec.record_collective("all_gather_into_tensor", group_size=tp, outputs=[_hidden(s)[:batch] * scale_gather])
            # rows: [B], one per request; with request ids, a request's row is the same whatever its place
            rows = torch.tensor([q - 10 for q in request_order[:batch]]) if request_order is not None else torch.arange(batch)
            logits = step_logits(s, 4)[rows] * scale_logits
            hidden = _hidden(s)[rows]
            if bump_hidden_at is not None and s >= bump_hidden_at and r == tp - 1:
                hidden = hidden.clone()
                hidden[0, -1] += 1.0
            width = hidden.shape[1] // tp
            rec.record_outputs(logits=logits, hidden=hidden[:, r * width:(r + 1) * width].contiguous(),
                               tokens=logits.argmax(-1))
            rec.set_run(mode, key="bs4" if mode == "graph" else "", padded_size=4 if mode == "graph" else -1,
                        reason="test" if mode == "eager" else "")
            rec.end_step()
        rec.close()
        assert rec.error is None, rec.error
    return out


# -- same, different ----------------------------------------------------------------------------


def test_same_recordings_are_the_same(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=2, steps=4, name="a")
    b = make_recording(tmp_path, ranks=2, steps=4, name="b")
    res = run_cli("diff", a, b)
    assert res.code == 0, res.err
    first = res.out.splitlines()[0]
    assert first.startswith("the same:") and "2 ranks x 4 steps" in first
    assert "weights not recorded in either run" in res.out


def test_one_changed_field_names_the_first_step_and_field(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=4, steps=8, name="a")
    b = make_recording(tmp_path, ranks=4, steps=8, name="b", diverge_at=5, diverge_rank=2, field="tokens")
    res = run_cli("diff", a, b)
    assert res.code == 1, res.err
    first = res.out.splitlines()[0]
    assert first.startswith("different: rank 2 step 5: output.logits first differs; 3 of 8 steps differ")
    assert "first token divergence step 5 (tokens.tokens" in first
    r = diff(str(a), str(b))
    streams = {s.rank_a: s for s in r.streams}
    assert [streams[k].verdict for k in range(4)] == [DiffVerdict.SAME] * 2 + [DiffVerdict.DIFFERENT, DiffVerdict.SAME]
    assert streams[2].differing_steps == 3 and streams[2].first_token.step == 5
    assert streams[2].first_token.margin_a is not None


def test_an_input_difference_comes_first_in_program_order(tmp_path):
    a = make_recording(tmp_path, ranks=1, steps=4, name="a")
    b = make_recording(tmp_path, ranks=1, steps=4, name="b", diverge_at=2, diverge_rank=0, field="input")
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.DIFFERENT
    f = r.first[1]
    assert (f.step, f.field) == (2, "input.input_ids")
    # Inputs are kept in full: the first difference says by how much.
    assert f.comparison is not None and f.comparison["verdict"] == "different"


def test_one_changed_weight_is_named(tmp_path, run_cli):
    a = record_run(tmp_path / "a", weights=_weights(False))
    b = record_run(tmp_path / "b", weights=_weights(True), scale_logits=1.0 + 2**-20)
    res = run_cli("diff", a, b)
    assert res.code == 1, res.err
    assert res.out.splitlines()[0].startswith("different: rank 0 step 0: output.logits first differs")
    assert res.out.splitlines()[0].endswith(f"; weights differ: {WEIGHT}")
    weights_line = next(l for l in res.out.splitlines() if l.strip().startswith("weights"))
    assert f"1 differ: {WEIGHT}" in weights_line and "layers.0" not in weights_line
    out = run_cli("diff", a, b, "--json").json()
    assert [c["category"] for c in out["other_differences"]][0] == "weights"
    assert out["other_differences"][0]["items"][0]["name"] == WEIGHT


def test_weights_alone_make_runs_different(tmp_path):
    a = record_run(tmp_path / "a", weights=_weights(False))
    b = record_run(tmp_path / "b", weights=_weights(True))
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.DIFFERENT and r.exit_code == 1
    assert r.headline.startswith(f"different: weights differ ({WEIGHT})")


def test_config_and_numerics_differences_are_listed(tmp_path):
    a = record_run(tmp_path / "a", target_extra={"launch": {"env_numerics": {"NVIDIA_TF32_OVERRIDE": None}},
                                                 "numerics": {"first": "x", "contexts": {"x": {"backends.cuda.matmul.allow_tf32": False}}}})
    b = record_run(tmp_path / "b", target_extra={"config": {"layers": 3, "tp": 1},
                                                 "launch": {"env_numerics": {"NVIDIA_TF32_OVERRIDE": "0"}},
                                                 "numerics": {"first": "y", "contexts": {"y": {"backends.cuda.matmul.allow_tf32": True}}}})
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.SAME  # the steps computed the same bits; the settings differ
    by = {c.category.value: c for c in r.context}
    assert [i["name"] for i in by["config"].items] == ["layers"]
    names = {i["name"] for i in by["numerics"].items}
    assert "launch_env.NVIDIA_TF32_OVERRIDE" in names and "step_context.backends.cuda.matmul.allow_tf32" in names


# -- ranks and layouts ------------------------------------------------------------------------


def test_one_rank_against_another(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=4, steps=4, name="a", diverge_at=1, diverge_rank=3)
    res = run_cli("diff", f"{a}:run-000/0", f"{a}:run-000/1")
    assert res.code == 0 and res.out.startswith("the same:")
    res = run_cli("diff", f"{a}:run-000/0", f"{a}/run-000/rank-00003.h5")
    assert res.code == 1 and res.out.startswith("different: A rank 0 / B rank 3 step 1: output.logits")


def test_tp2_against_tp1_unshards_the_sharded_field(tmp_path, run_cli):
    tp2 = record_run(tmp_path / "tp2", tp=2)
    tp1 = record_run(tmp_path / "tp1", tp=1)
    res = run_cli("diff", tp2, tp1)
    assert res.code == 0, res.out + res.err
    assert res.out.startswith("the same:") and "1 field(s) compared unsharded" in res.out.splitlines()[0]
    assert "1 collective field(s) not compared: collectives differ with the layout" in res.out
    assert "output.hidden: the same at 5 step(s); A sharded on dim 1 (recorded placements), B replicated" in res.out
    # One shard element changed from step 3 on: found whole, at step 3.
    bad = record_run(tmp_path / "bad", tp=2, bump_hidden_at=3)
    r = diff(str(bad), str(tp1))
    assert r.verdict is DiffVerdict.DIFFERENT
    u = r.unsharded[0]
    assert (u.field, u.first_step, u.differing_steps) == ("output.hidden", 3, 2)
    assert u.comparison["mismatched"] == 1
    assert r.headline == "different: output.hidden (compared unsharded) first differs at step 3"


def test_declared_shard_dim_when_no_layout_is_recorded(tmp_path, run_cli):
    tp2 = record_run(tmp_path / "tp2", tp=2, placements=False)
    tp1 = record_run(tmp_path / "tp1", tp=1)
    res = run_cli("diff", tp2, tp1)
    assert res.code == 1
    assert "output.hidden has shape (4, 4) in A and (4, 8) in B and no layout is recorded: it cannot be unsharded" in res.out
    res = run_cli("diff", tp2, tp1, "--shard", "output.hidden=1")
    assert res.code == 0, res.out
    assert "A sharded on dim 1 (--shard)" in res.out


def test_digest_only_field_cannot_be_unsharded(tmp_path, run_cli):
    tp2 = record_run(tmp_path / "tp2", tp=2, outputs="digest")
    tp1 = record_run(tmp_path / "tp1", tp=1, outputs="digest")
    res = run_cli("diff", tp2, tp1)
    assert res.code == 1
    first = res.out.splitlines()[0]
    assert first.startswith("not shown to be the same: output.hidden: A: sharded on dim 1 and recorded as a digest only on rank 0")
    assert "cannot be unsharded" in first
    out = run_cli("diff", tp2, tp1, "--json").json()
    assert out["unsharded"][0]["verdict"] == "not shown to be the same" and out["unsharded"][0]["compared_steps"] == 0


# -- batching ---------------------------------------------------------------------------------


def test_different_batching_without_request_ids_says_it_cannot_align(tmp_path):
    a = record_run(tmp_path / "a", batch=4)
    b = record_run(tmp_path / "b", batch=2)
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.DIFFERENT
    assert r.batching is not None and not r.batching.aligned
    assert "input.hidden has shape (4, 8) in A and (2, 8) in B at step 0" in r.batching.evidence
    assert "rows cannot be aligned: the recordings have no request ids" in r.batching.note


def test_different_batching_aligned_by_request_and_position(tmp_path):
    a = record_run(tmp_path / "a", batch=4, request_order=[10, 11, 12, 13])
    b = record_run(tmp_path / "b", batch=2, request_order=[13, 11])  # other requests, another order
    r = diff(str(a), str(b))
    bt = r.batching
    assert bt is not None and bt.aligned
    # Requests 10 and 11 ran in both: 2 rows x 5 positions, same tokens (same logits rows).
    assert (bt.rows_compared, bt.rows_differ, bt.fields) == (10, 0, ["output.hidden", "output.logits", "tokens.tokens"])
    # A request whose logits row changed is found by request and position, whatever its batch row.
    c = record_run(tmp_path / "c", batch=2, request_order=[10, 11], scale_logits=1.5)
    bt = diff(str(a), str(c)).batching
    assert bt.rows_differ == 10 and bt.first == {"request": 10, "position": 0, "field": "output.logits", "step_a": 0, "step_b": 0}


# -- tolerance --------------------------------------------------------------------------------


def test_tolerance_and_logit_agreement(tmp_path, run_cli):
    a = record_run(tmp_path / "a")
    b = record_run(tmp_path / "b", scale_logits=1.0 + 1e-6)
    res = run_cli("diff", a, b)
    assert res.code == 1 and res.out.startswith("different: rank 0 step 0: output.logits first differs")
    assert "argmax agrees on 100.0% of rows" in res.out and "top-k overlap 1.00" in res.out
    res = run_cli("diff", a, b, "--rtol", "1e-4")
    assert res.code == 0, res.out
    assert res.out.startswith("the same within tolerance (rtol=0.0001): 5 field(s) differ in bits")
    res = run_cli("diff", a, b, "--ulp", "0")
    assert res.code == 1 and "first beyond tolerance at step 0 output.logits" in res.out
    res = run_cli("diff", a, b, "--ulp", "64")
    assert res.code == 0, res.out


def test_within_tolerance_fields_are_not_the_headline_when_only_the_weights_differ(tmp_path, run_cli):
    """The outputs are the same within the tolerance asked for and the weights differ: the runs
    are different because of the weights, and the headline says so (it said "output.logits first
    differs; 5 of 5 steps differ" over a table of "the same within tolerance")."""
    a = record_run(tmp_path / "a", weights=_weights(False))
    b = record_run(tmp_path / "b", scale_logits=1.0 + 1e-6, weights=_weights(True))
    res = run_cli("diff", a, b, "--rtol", "1e-4")
    assert res.code == 1, res.out
    assert res.out.startswith(f"different: weights differ ({WEIGHT}); every step's fields are the same within tolerance "
                              "(rtol=0.0001): 5 field(s) differ in bits"), res.out


def test_tolerance_cannot_be_applied_to_digests(tmp_path):
    a = make_recording(tmp_path, ranks=1, steps=3, name="a")
    b = make_recording(tmp_path, ranks=1, steps=3, name="b", diverge_at=0, diverge_rank=0)
    r = diff(str(a), str(b), DiffOptions(rtol=1.0))
    assert r.verdict is DiffVerdict.DIFFERENT
    assert "3 differing field(s) recorded as digests only: tolerance cannot be applied" in r.streams[0].reasons


# -- steps that raised or were not run --------------------------------------------------------


def test_a_missing_step_is_a_difference(tmp_path):
    a = make_recording(tmp_path, ranks=1, steps=5, name="a")
    b = make_recording(tmp_path, ranks=1, steps=3, name="b")
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.DIFFERENT
    assert r.headline == "different: rank 0: 2 steps recorded in A only (first: 3)"
    # The rank's row says why it is "different", where no field differs (before: a bare "-").
    from replay.cli.diff import render_diff

    row = next(line for line in render_diff(r).splitlines() if line.lstrip().startswith("rank 0"))
    assert "different  2 steps recorded in A only (first: 3)" in row, row


def test_a_step_that_raised_in_both_is_not_called_the_same(tmp_path):
    for name in ("a", "b"):
        rec = Recorder(RecorderConfig(out=tmp_path / name))
        rec.begin_step()
        rec.record_inputs(**step_inputs(0))
        rec.end_step(error="RuntimeError: boom")
        rec.close()
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.verdict is DiffVerdict.INCOMPLETE and r.exit_code == 1
    assert r.headline.startswith("not shown to be the same: rank 0: 1 step raised in A (first: step 0: RuntimeError: boom)")


def test_runs_that_recorded_only_inputs_are_not_called_the_same(tmp_path):
    """Equal inputs say nothing of what the steps computed: no output or token field, no "same"."""
    for name in ("a", "b"):
        rec = Recorder(RecorderConfig(out=tmp_path / name))
        for s in range(3):
            rec.begin_step()
            rec.record_inputs(**step_inputs(s))
            rec.end_step()
        rec.close()
    r = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.verdict is DiffVerdict.INCOMPLETE and r.exit_code == 1
    assert r.headline == ("not shown to be the same: only what went into the steps was recorded (no output or token "
                          "field): what the steps computed was not compared"), r.headline


# -- output, errors ---------------------------------------------------------------------------


def test_json_output(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=2, steps=4, name="a")
    b = make_recording(tmp_path, ranks=2, steps=4, name="b", diverge_at=2, diverge_rank=1)
    res = run_cli("diff", a, b, "--json")
    assert res.code == 1
    out = res.json()
    assert out["verdict"] == "different" and out["same"] is False
    assert out["first_difference"]["stream"] == "rank 1" and out["first_difference"]["step"] == 2
    assert out["first_difference"]["field"] == "output.logits"
    assert out["first_token_divergence"] is None
    assert [s["differing_steps"] for s in out["streams"]] == [0, 2]
    assert [c["category"] for c in out["other_differences"]] == [
        "weights", "config", "step arguments", "numerics", "buffers", "tuner choices", "graph kernels", "versions", "environment"]


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["{a}", "{tmp}/nowhere"], 3, "no recording at"),
        (["{a}:run-009", "{a}"], 2, "has no part 'run-009'"),
        (["{a}:run-000/7", "{a}"], 2, "has no rank 7"),
        (["{a}:run 000", "{a}"], 2, "is not PATH, PATH:PART or PATH:PART/RANK"),
        (["{a}", "{a}", "--rtol", "-1"], 2, "--rtol must be a finite number >= 0"),
        (["{a}", "{a}", "--shard", "hidden"], 2, "write FIELD=DIM"),
        (["{a}"], 2, "Missing argument"),
        (["{a}", "{tmp}/file.txt"], 2, "is a file, not a recording"),
        (["{a}", "{tmp}/damaged"], 4, "cannot be read"),
    ],
    ids=["not-found", "no-part", "no-rank", "bad-spec", "bad-rtol", "bad-shard", "one-side", "a-file", "damaged"],
)
def test_bad_input_is_one_line_and_an_exit_code(tmp_path, run_cli, args, code, message):
    a = make_recording(tmp_path, ranks=2, steps=2, name="a")
    (tmp_path / "file.txt").write_text("x")
    bad = shutil.copytree(a, tmp_path / "damaged")
    (bad / "run-000" / "rank-00000.h5").write_bytes(b"not hdf5")
    (bad / "run-000" / "rank-00001.h5").write_bytes(b"not hdf5")
    res = run_cli("diff", *[x.format(a=a, tmp=tmp_path) for x in args])
    assert res.code == code, (res.code, res.out, res.err)
    assert res.err.count("\n") == 1 and message in res.err and "Traceback" not in res.err


def test_newer_format_exit_code(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=1, steps=2, name="a")
    b = shutil.copytree(a, tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    m["format_version"] = 99
    (b / "manifest.json").write_text(json.dumps(m))
    res = run_cli("diff", a, b)
    assert res.code == 5 and "upgrade replay" in res.err


def test_recording_text_is_escaped(tmp_path, run_cli):
    a = record_run(tmp_path / "a", target_extra={"config": {"name": "ok"}})
    b = record_run(tmp_path / "b", target_extra={"config": {"name": "\x1b]0;pwned\x07evil"}})
    res = run_cli("diff", a, b)
    assert "\x1b" not in res.out and "\\x1b]0;pwned\\x07evil" in res.out


def test_help_has_examples(run_cli):
    res = run_cli("diff", "--help")
    assert res.code == 0 and "replay diff recA:run-000/3 recB:run-000/0" in res.out and "Exit status" in res.out


# -- the report -------------------------------------------------------------------------------


def test_report_against_another_run(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=2, steps=4, name="a")
    b = make_recording(tmp_path, ranks=2, steps=4, name="b", diverge_at=2, diverge_rank=1, field="tokens")
    page = tmp_path / "r.html"
    res = run_cli("report", a, "--against", b, "-o", page)
    assert res.code == 0, res.err
    lines = res.out.splitlines()
    assert lines[0].startswith("different: rank 1 step 2: output.logits first differs") and lines[1] == str(page)
    text = page.read_text()
    assert '<section id="diff"><h2>Against another run</h2>' in text and '<a href="#diff">' in text
    assert "step 2 <code>tokens.tokens</code>" in text and "weights not recorded in either run" in text
    data = run_cli("report", a, "--against", b, "-o", page, "--json").json()
    assert data["diff"]["verdict"] == "different" and data["diff"]["first_token_divergence"]["step"] == 2


def test_report_against_a_missing_run_is_one_line(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=1, steps=2, name="a")
    res = run_cli("report", a, "--against", tmp_path / "nowhere", "-o", tmp_path / "r.html")
    assert res.code == 3 and res.err.count("\n") == 1 and not (tmp_path / "r.html").exists()


def _browser_or_skip() -> str:
    from scripts.report_check import find_chromium

    exe = find_chromium()
    if exe is None:
        why = Path(__file__).resolve().parents[1] / ".make" / "browser-unavailable"
        reason = why.read_text().strip() if why.exists() else "no chromium on PATH (scripts/install_browser.sh installs it)"
        pytest.skip(f"no headless browser: {reason}")
    return exe


def test_diff_section_renders_in_headless_chromium(tmp_path, run_cli):
    _browser_or_skip()
    from scripts.report_check import screenshot

    a = make_recording(tmp_path, ranks=2, steps=4, name="a")
    b = make_recording(tmp_path, ranks=2, steps=4, name="b", diverge_at=2, diverge_rank=1)
    page = tmp_path / "r.html"
    assert run_cli("report", a, "--against", b, "-o", page).code == 0
    png = tmp_path / "r.png"
    screenshot(page, png, width=1200, height=1400)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_parallel_streams_give_the_serial_answer(tmp_path, monkeypatch):
    import replay.analysis.diff as d

    a = make_recording(tmp_path, ranks=3, steps=6, name="a")
    b = make_recording(tmp_path, ranks=3, steps=6, name="b", diverge_at=4, diverge_rank=1, field="tokens")
    serial = diff(str(a), str(b)).to_json()
    monkeypatch.setattr(d, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(d, "_idle_cores", lambda: 2)
    calls = []
    real = d.ProcessPoolExecutor
    monkeypatch.setattr(d, "ProcessPoolExecutor", lambda **kw: calls.append(kw) or real(**kw))
    parallel = diff(str(a), str(b)).to_json()
    assert calls and calls[0]["max_workers"] == 2, "the pool was not used"
    assert parallel == serial


def test_a_rank_file_missing_from_one_run_is_not_called_the_same(tmp_path):
    a = make_recording(tmp_path, ranks=3, steps=3, name="a")
    b = make_recording(tmp_path, ranks=3, steps=3, name="b")
    for f in (b / "run-000").glob("rank-00002.*"):
        f.unlink()
    r = diff(str(a), str(b))
    assert [s.name for s in r.streams] == ["rank 0", "rank 1"]
    assert r.verdict is DiffVerdict.INCOMPLETE and r.exit_code == 1
    assert r.headline == "not shown to be the same: rank 2: no rank file in B, not compared"


def test_a_graph_difference_says_how_each_run_ran_the_step(tmp_path, run_cli):
    a = record_run(tmp_path / "a", mode="eager")
    b = record_run(tmp_path / "b", mode="graph")
    res = run_cli("diff", a, b)
    assert res.code == 1
    assert res.out.startswith("different: rank 0 step 0: graph first differs; 5 of 5 steps differ; no token divergence")
    assert "A ran eager (test), B ran graph bs4 (padded to 4)" in res.out
    # Only the graph differs: the outputs have the same bits, and the diff says so by naming no other field.
    assert "rank 0: fields that differ: graph (5 steps)" in res.out


def test_the_step_whose_numerics_context_first_differs(tmp_path):
    contexts = {"c0": {"backends.cuda.matmul.allow_tf32": False}, "c1": {"backends.cuda.matmul.allow_tf32": True}}
    a = record_run(tmp_path / "a", numerics=["c0"] * 5, target_extra={"numerics": {"first": "c0", "contexts": contexts}})
    b = record_run(tmp_path / "b", numerics=["c0"] * 3 + ["c1"] * 2,
                   target_extra={"numerics": {"first": "c0", "contexts": contexts}})
    r = diff(str(a), str(b))
    num = next(c for c in r.context if c.category.value == "numerics")
    assert num.note == "the step contexts first differ at step 3 (2 steps differ)"
    assert [(i["name"], i["a"], i["b"]) for i in num.items] == [("step 3: backends.cuda.matmul.allow_tf32", False, True)]


def test_atol_alone_means_rtol_zero(tmp_path):
    a = record_run(tmp_path / "a")
    b = record_run(tmp_path / "b", scale_logits=1.0 + 1e-6)
    # Logits are ~N(0, 1): a relative change of 1e-6 moves them by well under 1e-5 ...
    assert diff(str(a), str(b), DiffOptions(atol=1e-5)).verdict is DiffVerdict.WITHIN_TOLERANCE
    # ... and by more than 1e-9: with rtol 0, not within.
    assert diff(str(a), str(b), DiffOptions(atol=1e-9)).verdict is DiffVerdict.DIFFERENT


def test_recordings_of_several_parts_are_compared_part_by_part(tmp_path, run_cli):
    a = make_recording(tmp_path, ranks=1, steps=2, name="a", part="run-000")
    make_recording(tmp_path, ranks=1, steps=2, name="a", part="run-001")
    b = make_recording(tmp_path, ranks=1, steps=2, name="b", part="run-000")
    make_recording(tmp_path, ranks=1, steps=2, name="b", part="run-001", diverge_at=1, diverge_rank=0)
    res = run_cli("diff", a, a)
    assert res.code == 0 and res.out.startswith("the same: all 2 parts (run-000, run-001)")
    res = run_cli("diff", a, b)
    assert res.code == 1
    assert res.out.startswith("different: 1 of 2 parts; first run-001: different: rank 0 step 1: output.logits first differs")
    assert "== part run-000 ==\nthe same:" in res.out
    out = run_cli("diff", a, b, "--json").json()
    assert out["parts"]["run-001"]["first_difference"]["step"] == 1 and out["parts"]["run-000"]["same"]
    # One side with several parts against one part: which part is meant must be said.
    c = make_recording(tmp_path, ranks=1, steps=2, name="c")
    res = run_cli("diff", a, c)
    assert res.code == 2 and f"has 2 parts (run-000, run-001): name one, e.g. {a}:run-000" in res.err
    assert run_cli("diff", f"{a}:run-000", f"{a}:run-001").code == 0
    assert run_cli("diff", a / "run-000", a / "run-001").code == 0  # part directories work too


def test_an_unsealed_journal_is_compared_too(tmp_path):
    a = make_recording(tmp_path, ranks=1, steps=4, name="a")
    b = tmp_path / "b"
    rec = Recorder(RecorderConfig(out=b))
    for s in range(4):
        rec.begin_step()
        rec.record_inputs(**step_inputs(s))
        logits = step_logits(s)
        if s == 3:
            logits.view(torch.int32)[0, 0] ^= 1
        rec.record_outputs(logits=logits, tokens=logits.argmax(-1), accepted=torch.ones(4, dtype=torch.int64))
        rec.set_run("graph" if s % 2 == 0 else "eager", key="bs4", padded_size=4, reason="" if s % 2 == 0 else "test")
        rec.end_step()
    # Still recording: only the journal exists, and it is read as it stands (once the drain has
    # moved the steps out of the record ring into it).
    rec.drain()
    assert (b / "run-000" / "rank-00000.journal").exists() and not (b / "run-000" / "rank-00000.h5").exists()
    r = diff(str(a), str(b))
    rec.close()
    assert r.verdict is DiffVerdict.DIFFERENT and (r.first[1].step, r.first[1].field) == (3, "output.logits")


def test_a_part_in_one_recording_only_is_not_called_the_same(tmp_path):
    a = make_recording(tmp_path, ranks=1, steps=2, name="a", part="run-000")
    make_recording(tmp_path, ranks=1, steps=2, name="a", part="run-001")
    b = make_recording(tmp_path, ranks=1, steps=2, name="b", part="run-000")
    make_recording(tmp_path, ranks=1, steps=2, name="b", part="run-002")
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.INCOMPLETE and r.exit_code == 1
    assert r.headline == ("not shown to be the same: the common part is the same, but not compared: "
                          "run-001 (in A only), run-002 (in B only)")


def test_collective_outputs_kept_in_full_take_a_tolerance(tmp_path):
    a = record_run(tmp_path / "a", tp=2)
    b = record_run(tmp_path / "b", tp=2, scale_gather=1.0 + 1e-6)
    r = diff(str(a), str(b))
    assert r.verdict is DiffVerdict.DIFFERENT and r.first[1].field == "collective.0.all_gather_into_tensor"
    c = r.first[1].comparison
    assert c["mismatched"] > 0 and 0 < c["max_abs"] < 1e-4
    assert diff(str(a), str(b), DiffOptions(rtol=1e-4)).verdict is DiffVerdict.WITHIN_TOLERANCE


def test_weights_across_layouts_are_not_called_the_same(tmp_path):
    """Shards (another digest on each rank of a run) cannot be compared across layouts."""
    from replay.digest import digest, format_digest

    def shards(rank: int) -> dict:
        return {**_weights(False), WEIGHT: {"digest": format_digest(digest(torch.full((8, 8), float(rank)))), "shape": [8, 8],
                                            "dtype": "float32"}}

    tp2 = record_run(tmp_path / "tp2", tp=2, weights=shards)
    tp1 = record_run(tmp_path / "tp1", tp=1, weights=_weights(True))
    w = next(c for c in diff(str(tp2), str(tp1)).context if c.category.value == "weights")
    assert not w.compared and "cannot be compared across layouts" in w.note
    assert "the 1 replicated in both runs have the same digests" in w.note


def test_replicated_weights_across_layouts_are_compared_by_digest(tmp_path):
    """A parameter with one digest on every rank of each run is replicated: its digests compare
    across layouts (the one that differs is named; the same one is not a difference)."""
    tp2 = record_run(tmp_path / "tp2", tp=2, weights=_weights(False))
    tp1 = record_run(tmp_path / "tp1", tp=1, weights=_weights(True))
    w = next(c for c in diff(str(tp2), str(tp1)).context if c.category.value == "weights")
    assert w.compared and [i["name"] for i in w.items] == [WEIGHT] and w.items[0]["why"].startswith("digest (replicated")
    same = record_run(tmp_path / "tp1same", tp=1, weights=_weights(False))
    w = next(c for c in diff(str(tp2), str(same)).context if c.category.value == "weights")
    assert not w.items and "the 2 replicated in both runs have the same digests" in w.note


# -- shard layouts of the weights (replay.record.weights) ---------------------------------------


def _param(shape: list[int], layout: dict | None = None, fill: float = 1.0) -> dict:
    from replay.digest import digest, format_digest

    entry = {"digest": format_digest(digest(torch.full(shape, fill))), "shape": shape, "dtype": "torch.float32"}
    if layout is not None:
        entry["layout"] = layout
    return entry


@pytest.mark.parametrize("layout_a, shape_b, expected", [
    ({"shard_dim": 0, "declared": True}, [8, 8], None),  # the same whole shape: sharded as recorded, not a difference
    ({"placements": ["Shard(0)"], "mesh": [2], "global_shape": [8, 8]}, [8, 8], None),
    ({"shard_dim": 0, "declared": True}, [6, 8], "whole shape, from the recorded shard layouts"),
    (None, [8, 8], "no shard layout is recorded: may be a shard"),  # never guessed from shapes
], ids=["declared", "dtensor", "declared-other-shape", "none"])
def test_recorded_weight_layouts_across_tp(tmp_path, layout_a, shape_b, expected):
    tp2 = record_run(tmp_path / "tp2", tp=2, weights={"w": _param([4, 8], layout_a)})
    tp1 = record_run(tmp_path / "tp1", tp=1, weights={"w": _param(shape_b)})
    w = next(c for c in diff(str(tp2), str(tp1)).context if c.category.value == "weights")
    if expected is None:
        assert not w.compared and "cannot be compared across layouts" in w.note  # digests of shards: values unknown
    else:
        assert w.differs and expected in w.items[0]["why"], w.items


def test_weight_digests_record_dtensor_placements_and_declared_shards(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from replay.analysis.unshard import LayoutKind, layout_of, param_global_shape
    from replay.record.weights import weight_digests

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        net[0].weight = torch.nn.Parameter(distribute_tensor(net[0].weight.detach(), mesh, [Shard(0)]))
        net[0].bias = torch.nn.Parameter(distribute_tensor(net[0].bias.detach(), mesh, [Replicate()]))
        w = weight_digests(net, {"1.w*": 1})
    finally:
        dist.destroy_process_group()
    assert w["0.weight"]["layout"] == {"placements": ["Shard(0)"], "mesh": [1], "global_shape": [6, 4]}
    assert w["0.bias"]["layout"]["placements"] == ["Replicate()"]
    assert w["1.weight"]["layout"] == {"shard_dim": 1, "declared": True}
    assert "layout" not in w["1.bias"]  # a plain tensor nobody declared: no layout, never a guess
    assert layout_of(w["0.weight"]["layout"]).kind is LayoutKind.SHARDED and layout_of(w["0.weight"]["layout"]).dim == 0
    assert param_global_shape(w["1.weight"], 4) == (2, 24) and param_global_shape(w["1.bias"], 4) is None


def test_different_batching_says_what_aligned_rows_found_not_a_batch_token_divergence(tmp_path, run_cli):
    """The headline named a "first token divergence" between a batch of two requests and a batch
    of one (step N of A is not step N of B); with no request in both runs it printed "0 of 0 rows
    differ ()", and fields kept as digests went unmentioned beside "0 of 10 rows differ"."""
    a = record_run(tmp_path / "a", batch=2, request_order=[10, 11])
    b = record_run(tmp_path / "b", batch=1, request_order=[12])  # no request of A's
    res = run_cli("diff", a, b)
    head = res.out.splitlines()[0]
    assert res.code == 1 and "token divergence" not in head and "rows cannot be aligned" in head, res.out
    assert "rows cannot be aligned: no (request, position) row was recorded in both runs" in res.out
    assert "0 of 0" not in res.out
    # Logits kept as digests only: the tokens' rows are compared, and the logits said not to be.
    c = record_run(tmp_path / "c", batch=4, request_order=[10, 11, 12, 13], outputs="digest")
    d = record_run(tmp_path / "d", batch=2, request_order=[10, 11], outputs="digest", scale_logits=1.5)
    res = run_cli("diff", c, d)
    assert "by request and position, 0 of 10 rows differ in tokens.tokens" in res.out.splitlines()[0], res.out
    assert "output.hidden, output.logits recorded as digests only, whose rows cannot be compared" in res.out


def _record_with_temperature(out: Path, temp: float, *, logits_scale: float = 1.0) -> Path:
    rec = Recorder(RecorderConfig(out=out, rank=0, world_size=1))
    rec.set_target({"factory": "tests.toy:build", "config": {"layers": 2, "tp": 1}})
    for s in range(4):
        rec.begin_step()
        rec.record_args(temp=temp, top_k=5)
        rec.record_inputs(**step_inputs(s, 4))
        logits = step_logits(s, 4) * logits_scale
        rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
        rec.end_step()
    rec.close()
    assert rec.error is None, rec.error
    return out


def test_a_plain_step_argument_that_differs_is_named(tmp_path, run_cli):
    """A temperature passed to the step (0.9 in A, 0.5 in B): diff listed weights, config and
    numerics as the same and never named it, even where it was the whole cause."""
    a = _record_with_temperature(tmp_path / "a", 0.9)
    b = _record_with_temperature(tmp_path / "b", 0.5)
    res = run_cli("diff", a, b)
    assert res.code == 0 and res.out.startswith("the same:")  # the fields' bits are the same
    assert "step arguments  1 differ: temp (from step 0, 4 steps): A 0.9, B 0.5" in res.out, res.out
    c = _record_with_temperature(tmp_path / "c", 0.5, logits_scale=2.0)
    head = run_cli("diff", a, c).out.splitlines()[0]
    assert head.startswith("different:") and "the step's argument temp differs from step 0: A 0.9, B 0.5" in head, head
    same = run_cli("diff", a, a, "--json").json()
    args = next(x for x in same["other_differences"] if x["category"] == "step arguments")
    assert args["compared"] and not args["differs"]


def test_a_step_argument_of_another_rank_pair_is_named_across_world_sizes(tmp_path, run_cli):
    """Two ranks against one: the pair A rank 1 / B rank 0 differs in the step's rank argument,
    and diff said "step arguments the same" (it looked at the first pair only)."""
    def run(out: Path, world: int) -> Path:
        for r in range(world):
            rec = Recorder(RecorderConfig(out=out, rank=r, world_size=world))
            for s in range(3):
                rec.begin_step()
                rec.record_inputs(**step_inputs(s, 4))
                rec.record_args(rank=r)
                logits = step_logits(s, 4)
                rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
                rec.end_step()
            rec.close()
        return out

    res = run_cli("diff", run(tmp_path / "a", 2), run(tmp_path / "b", 1))
    assert "step arguments  1 differ: rank (from step 0, 3 steps): A 1, B 0 [A r1 / B r0]" in res.out, res.out


def test_a_step_that_raised_in_one_run_is_the_first_difference(tmp_path, run_cli):
    """Step 2 raised in B (a rank killed inside it): diff led with "step 2: graph first differs
    ... recorded in A only", a field the raised step never recorded, on a run with no graphs."""
    def run(out: Path, raise_at: int | None) -> Path:
        rec = Recorder(RecorderConfig(out=out, rank=0, world_size=1))
        for s in range(4):
            rec.begin_step()
            rec.record_inputs(**step_inputs(s, 4))
            if s == raise_at:
                rec.end_step(error=RuntimeError("the program ended inside this step"))
                continue
            logits = step_logits(s, 4)
            rec.record_outputs(logits=logits, tokens=logits.argmax(-1))
            rec.set_run("eager", reason="test")
            rec.end_step()
        rec.close()
        return out

    a, b = run(tmp_path / "a", None), run(tmp_path / "b", 2)
    res = run_cli("diff", a, b)
    head = res.out.splitlines()[0]
    assert res.code == 1 and head.startswith("different: rank 0 step 2: step status (raised) first differs"), res.out
    assert "raised in B only: RuntimeError: the program ended inside this step" in res.out, res.out
