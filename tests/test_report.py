"""`replay report`: the HTML page, its data (--json), large recordings, bad input; progress bars."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from replay.format.h5 import write_rank_file
from replay.format.schema import (
    COLLECTIVE_DTYPE,
    FIELD_DTYPE,
    GRAPH_DTYPE,
    KERNEL_DTYPE,
    KEYFRAME_DTYPE,
    REPLAY_DTYPE,
    STEP_DTYPE,
    TENSOR_DTYPE,
    TUNER_DTYPE,
)
from replay.format.tables import RankTables
from replay.report import build_report, write_report
from replay.report.data import MAX_BINS, Cell
from replay.report.html import SECTIONS
from tests.factories import make_recording

SECTION_IDS = [sid for sid, _ in SECTIONS]


def _check_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page.lower()
    assert not re.search(r"(src|href)\s*=\s*\"(?!data:|#)", page), "only data: URIs and in-page anchors"
    assert "http://" not in page and "https://" not in page and "@import" not in page
    for sid in SECTION_IDS:
        assert f'<section id="{sid}">' in page, sid


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diverged")
    return make_recording(tmp, ranks=4, steps=12, diverge_at=7, diverge_rank=2, field="tokens")


def test_report_shows_the_divergence(diverged, run_cli):
    res = run_cli("report", diverged)
    assert res.code == 0, res.err
    path = Path(res.out.splitlines()[-1])
    assert path == diverged / "report.html" and res.err == ""
    page = path.read_text()
    _check_self_contained(page)
    assert "First divergence: step 7, rank 2, field <code>output.logits</code>" in page
    assert "First token divergence: step 7, rank 2" in page
    assert "replay step " in page and "--rank 2 --step 7" in page
    # map, accepted tokens, margins, timeline: each an embedded PNG
    assert page.count('src="data:image/png;base64,') == 4


def test_report_json_is_the_data_behind_the_page(diverged, run_cli, tmp_path):
    out = tmp_path / "r.html"
    res = run_cli("report", diverged, "-o", out, "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["report"] == str(out) and out.exists()
    for key in ("recording", "part", "first_divergence", "first_token_divergence", "steps", "bins", "agreement",
                "accepted", "margins", "timeline", "tuner", "kernels", "results"):
        assert key in data, key
    assert (data["first_divergence"]["step"], data["first_divergence"]["ranks"]) == (7, [2])
    cells = np.array(data["agreement"]["cells"])
    assert cells.shape == (4, 12) and data["bins"]["size"] == 1
    assert (cells[2, 7:] == Cell.TOKENS).all() and (cells[2, :7] == Cell.AGREE).all()
    assert (cells[[0, 1, 3]] == Cell.AGREE).all()
    assert data["agreement"]["token_divergent_steps"]["first"][:1] == [7]
    assert data["accepted"]["mean_per_step"][0] == [4.0] * 12
    assert data["margins"]["at_first_token_divergence"]["step"] == 7
    # graph on even steps, eager ("test") on odd ones
    assert data["timeline"]["cells"][0][:4] == [0, -1, 0, -1]
    assert data["timeline"]["per_rank"][0]["eager_reasons"] == {"test": 6}


@pytest.mark.parametrize(
    "field, code", [("output", Cell.OUTPUT), ("input", Cell.INPUT)], ids=["output-bits", "inputs"]
)
def test_map_names_what_differs(tmp_path, field, code):
    rec = make_recording(tmp_path, ranks=3, steps=6, diverge_at=4, diverge_rank=1, field=field)
    rep = build_report(rec)
    assert rep.cells[1, 4:].tolist() == [code, code] and (rep.cells[1, :4] == Cell.AGREE).all()
    assert rep.first_token_divergence is None and rep.token_divergent_steps.size == 0


def test_no_divergence(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=2, steps=5)
    res = run_cli("report", rec)
    assert res.code == 0, res.err
    page = Path(res.out.splitlines()[-1]).read_text()
    _check_self_contained(page)
    assert "No divergence" in page and "First divergence" not in page
    assert "Tuner choices agree on every rank" in page and "No saved results yet" in page
    assert (build_report(rec).cells == Cell.AGREE).all()


def _big_recording(root: Path, ranks: int, steps: int, diverge_at: int, odd: int = 1) -> Path:
    """Rank files written straight from tables: thousands of steps in well under a second."""
    part = root / "run-000"
    part.mkdir(parents=True)
    strings = ["input.input_ids", "graph", "output.logits", "tokens.tokens", "decode-bs8", "decode-bs4", "prefill"]
    s = np.arange(steps)
    rng = np.random.default_rng(0)
    base = rng.integers(1, 2**62, size=(steps, 4), dtype=np.int64).astype(np.uint64)
    margin = np.exp(rng.normal(-1, 1.2, steps)).astype(np.float32)
    accepted = rng.integers(1, 5, steps)
    eager = s % 97 == 5
    empty = {name: np.zeros(0, dt) for name, dt in [("tensors", TENSOR_DTYPE), ("graphs", GRAPH_DTYPE), ("kernels", KERNEL_DTYPE),
             ("replays", REPLAY_DTYPE), ("collectives", COLLECTIVE_DTYPE), ("keyframes", KEYFRAME_DTYPE), ("tuner", TUNER_DTYPE)]}
    for r in range(ranks):
        dig, acc = base.copy(), accepted.copy()
        if r == odd:
            dig[diverge_at:, 2] += np.uint64(1)  # output bits first, tokens three steps later
            dig[diverge_at + 3 :, 3] += np.uint64(1)
            acc[diverge_at + 3 :] = 1
        fields = np.zeros(steps * 4, FIELD_DTYPE)
        fields["step"], fields["order"] = np.repeat(s, 4), np.tile(np.arange(4), steps)
        fields["field"], fields["digest"] = np.tile(np.arange(4), steps), dig.reshape(-1)
        st = np.zeros(steps, STEP_DTYPE)
        st["step"], st["mode"], st["graph"] = s, np.where(eager, 1, 2), -1
        st["graph_key"] = np.where(eager, -1, np.where(s < steps // 2, 4, 5))
        st["padded_size"] = np.where(s < steps // 2, 8, 4)
        st["reason"] = np.where(eager, 6, -1)
        st["margin"], st["accepted"] = margin, acc
        t = RankTables(attrs={"rank": r, "world_size": ranks, "part": "run-000", "complete": True}, strings=strings,
                       steps=st, fields=fields, **empty)
        write_rank_file(t, part / f"rank-{r:05d}.h5", f"rank-{r:05d}.payload")
    return root


def test_large_recording_is_binned_and_quick(tmp_path, run_cli):
    rec = _big_recording(tmp_path / "big", ranks=4, steps=5000, diverge_at=3213)
    t = time.perf_counter()
    res = run_cli("report", rec, "--json")
    took = time.perf_counter() - t
    assert res.code == 0, res.err
    data = res.json()
    assert took < 20, f"report of 4 x 5,000 steps took {took:.1f} s"
    assert data["steps"]["count"] == 5000 and data["bins"]["size"] == 5
    cells = np.array(data["agreement"]["cells"])
    assert cells.shape == (4, MAX_BINS)
    first_bin = int(np.searchsorted(data["bins"]["first_steps"], 3213, side="right")) - 1
    assert cells[1, first_bin] == Cell.OUTPUT and cells[1, first_bin + 1] == Cell.TOKENS and (cells[1, :first_bin] == 0).all()
    assert (data["first_divergence"]["step"], data["first_token_divergence"]["step"]) == (3213, 3216)
    assert data["accepted"]["ahead_of_median"][1][-1] < 0  # rank 1 accepted fewer tokens from then on
    assert [g["key"] for g in data["timeline"]["graphs"]] == ["decode-bs4", "decode-bs8"]
    page = Path(data["report"]).read_text()
    _check_self_contained(page)
    assert "Each column is 5 steps" in page
    assert len(page) < 1_500_000


def test_tuner_and_kernels_side_by_side(tmp_path):
    demo = pytest.importorskip("scripts.report_check")
    rec = demo.demo_recording(tmp_path / "demo", ranks=3, steps=30, odd_rank=1, flip_at=20)
    rep = build_report(rec)
    assert [r["op"] for r in rep.tuner_rows] == ["moe_gemm"] and rep.tuner_agreeing == 2
    assert rep.tuner_rows[0]["choices"]["1"] == "moe_gemm_tile128x64_splitk2"
    assert {k["key"] for k in rep.kernel_tables} == {"decode-bs4", "decode-bs8"}
    assert all(row["ordinal"] == 4 for k in rep.kernel_tables for row in k["rows"])
    page = write_report(rep).read_text()
    assert '<td class="odd">moe_gemm_tile128x64_splitk2</td>' in page
    assert "prefill: no graph for this shape" in page
    # the demo's saved results: a step verdict table, the per-layer curve, the config toggles
    assert "bitwise equal" in page and "first module that differs" in page and "tuner=off" in page
    assert page.count('src="data:image/png;base64,') == 5


def test_saved_results_are_data_and_odd_ones_are_skipped(diverged, tmp_path, run_cli):
    rec = tmp_path / "rec"
    shutil.copytree(diverged, rec)
    res_dir = rec / "results"
    res_dir.mkdir()
    files = {
        "a-step.json": {"kind": "step", "rank": 2, "step": 7, "verdicts": [{"a": "eager", "b": "graph", "verdict": "different", "max_abs": 0.5}, "junk"]},
        "b-layers.json": {"kind": "bisect-layers", "rank": 2, "step": 7, "between": ["eager", "cudagraph"], "first": "l.1",
                          "modules": [{"name": "l.0", "verdict": "bitwise equal", "max_abs": 0}, {"name": "l.1", "verdict": "different", "max_abs": 0.25}]},
        "c-layers-bad.json": {"kind": "bisect-layers", "modules": "not a list", "between": 3},
        "d-future.json": {"kind": "bisect-quantum", "x": 1},
        "e-steps.json": {"kind": "bisect-steps", "first": 5, "ranks": [2]},
        "f-config.json": {"kind": "bisect-config", "toggles": {"tf32": "off"}, "minimal": None},
        "g-nokind.json": {"rank": 1},
        "h-list.json": [1, 2, 3],
        "i-script.json": {"kind": "step", "rank": "<script>alert(1)</script>", "verdicts": []},
        "j-newer.json": {"kind": "bisect-steps", "format_version": 99, "first": 1234567},
    }
    for name, obj in files.items():
        (res_dir / name).write_text(json.dumps(obj))
    (res_dir / "z-broken.json").write_text("{not json")
    res = run_cli("report", rec)
    assert res.code == 0, res.err
    page = Path(res.out.splitlines()[-1]).read_text()
    _check_self_contained(page)
    assert "first module that differs: <b><code>l.1</code>" in page
    assert page.count('src="data:image/png;base64,') == 5  # the four plots and one layer curve
    assert "First step that differs: <b>5</b>" in page and "tf32" in page
    assert "d-future.json (kind bisect-quantum)" in page and "g-nokind.json" in page
    assert "h-list.json: not a JSON object" in page and "z-broken.json: not readable JSON" in page
    assert "&lt;script&gt;" in page
    # A result a newer replay saved is named, not misread.
    assert "j-newer.json: written by a newer replay (results format_version 99)" in page and "1234567" not in page
    data = run_cli("report", rec, "--json").json()
    assert sorted(r["_file"] for r in data["results"]) == sorted(n for n in files if n not in ("h-list.json", "j-newer.json"))


@pytest.mark.parametrize("damage", ["truncate", "missing", "not-a-recording", "bad-part"])
def test_bad_input_is_one_line(diverged, tmp_path, run_cli, damage):
    rec = tmp_path / "rec"
    shutil.copytree(diverged, rec, ignore=shutil.ignore_patterns("report.html"))
    args = ["report", rec]
    code = 4
    if damage == "truncate":
        f = rec / "run-000" / "rank-00001.h5"
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "missing":
        args = ["report", tmp_path / "nowhere"]
        code = 3
    elif damage == "not-a-recording":
        args = ["report", tmp_path / "empty"]
        (tmp_path / "empty").mkdir()
    else:
        args += ["--part", "run-999"]
        code = 2
    res = run_cli(*args)
    assert res.code == code, (res.code, res.out, res.err)
    assert res.err.count("\n") == 1 and "Traceback" not in res.err
    if damage == "truncate":
        # The rank that can be read is reported; the page and the line name the one left out.
        assert "rank 1 cannot be read" in res.err
        assert "Rank 1 is left out" in (rec / "report.html").read_text()
        return
    assert res.err.startswith("replay: error:")
    assert not (rec / "report.html").exists()


def test_unwritable_output_is_one_line(diverged, tmp_path, run_cli):
    res = run_cli("report", diverged, "-o", tmp_path / "no" / "such" / "dir.html")
    assert res.code == 1 and res.err.count("\n") == 1 and "does not exist" in res.err


def test_without_matplotlib_the_error_says_what_to_install(diverged, tmp_path, run_cli, monkeypatch):
    from replay.report import plots

    monkeypatch.setattr(plots, "_plt", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = run_cli("report", diverged, "-o", tmp_path / "r.html")
    assert res.code == 1 and res.err.count("\n") == 1 and "pip install" in res.err
    assert not (tmp_path / "r.html").exists()


def test_newest_recording_is_default(tmp_path, run_cli, monkeypatch):
    make_recording(tmp_path / "recordings", ranks=2, steps=3, name="20260101-000000-a")
    monkeypatch.chdir(tmp_path)
    res = run_cli("report")
    assert res.code == 0, res.err
    assert res.out.strip().endswith("20260101-000000-a/report.html") and "using the newest" in res.err


def test_help_has_an_example(run_cli):
    res = run_cli("report", "--help")
    assert res.code == 0 and "replay report recordings/" in res.out and "--json" in res.out


_NO_BROWSER = Path(__file__).resolve().parents[1] / ".make" / "browser-unavailable"  # issue 17: written by scripts/install_browser.sh


@pytest.mark.skipif(shutil.which("chromium") is None and not Path("/usr/bin/chromium").exists(),
                    reason="needs chromium: " + (_NO_BROWSER.read_text().strip() if _NO_BROWSER.exists()
                                                 else "run scripts/install_browser.sh"))  # issue 17: say why
def test_page_renders_in_headless_chromium(diverged, tmp_path):
    from scripts.report_check import screenshot

    page = write_report(build_report(diverged), tmp_path / "r.html")
    png = tmp_path / "r.png"
    screenshot(page, png, width=1200, height=1600)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


# -- terminal helpers -----------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_off_a_terminal(monkeypatch):
    from replay.cli.progress import progress

    monkeypatch.delenv("REPLAY_PROGRESS", raising=False)
    out = io.StringIO()
    assert list(progress(range(5), label="sealing", stream=out)) == [0, 1, 2, 3, 4]
    with progress(length=3, label="probes", stream=out) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def test_progress_draws_on_a_terminal_and_erases_itself(monkeypatch):
    from replay.cli.progress import progress

    monkeypatch.delenv("REPLAY_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    tty = _Tty()
    assert sum(progress(iter([1, 2, 3]), label="sealing", length=3, stream=tty)) == 6
    text = tty.getvalue()
    assert "sealing [" in text and "0/3" in text and text.endswith("\r\x1b[2K")
    monkeypatch.setenv("REPLAY_PROGRESS", "0")
    quiet = _Tty()
    list(progress(range(3), label="x", stream=quiet))
    assert quiet.getvalue() == ""


def test_colour_only_on_a_terminal(monkeypatch):
    from replay.cli import render

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert render.fmt_verdict("different") == "different"
    monkeypatch.setattr(sys, "stdout", _Tty())
    assert "\x1b[" in render.fmt_verdict("different")
    monkeypatch.setenv("NO_COLOR", "1")
    assert render.style("x", fg="red") == "x"


@pytest.mark.parametrize(
    "ranks, diverge_rank, field", [(4, 2, "output"), (3, 0, "input"), (5, 4, "tokens"), (2, 1, "output")],
    ids=["four-ranks", "rank-0-inputs", "five-ranks-tokens", "two-ranks"],
)
def test_info_and_report_agree_on_where_and_who(tmp_path, run_cli, ranks, diverge_rank, field):
    """One vote and one search: the report's map marks, at the first divergence info names, exactly
    the ranks info names odd; no step before it differs."""
    rec = make_recording(tmp_path, ranks=ranks, steps=9, diverge_at=3, diverge_rank=diverge_rank, field=field)
    info = run_cli("info", rec, "--json").json()
    rep = run_cli("report", rec, "--json").json()
    d = info["first_divergence"]
    assert rep["first_divergence"] == d and d["step"] == 3
    cells = np.array(rep["agreement"]["cells"])
    col = rep["bins"]["first_steps"].index(d["step"])
    odd = [r for i, r in enumerate(rep["agreement"]["ranks"]) if cells[i, col] > Cell.GRAPH]
    assert odd == d["ranks"]
    assert rep["agreement"]["divergent_steps"]["first"][0] == d["step"]


def test_report_across_streams_labels_the_divergence_and_lists_each_stream(tmp_path, run_cli):
    from tests.test_info import _streams_recording

    rec = _streams_recording(tmp_path, diverge_rank=1, diverge_step=5)
    res = run_cli("report", rec)
    assert res.code == 0, res.err
    page = Path(res.out.splitlines()[-1]).read_text()
    _check_self_contained(page)
    assert "First divergence: step 5 (stream draft, its step 3), rank 1, field <code>output.logits</code>" in page
    assert "2 models in one loop" in page
    assert re.search(r"<td>target</td><td class=\"num\">4</td><td class=\"num\">0</td><td class=\"num\">9</td>"
                     r"<td>step 6 \(stream target, its step 2\)", page), page[page.find("models in one loop"):][:800]
    assert "<td>draft</td><td class=\"num\">8</td>" in page
    # Rank 1 differs from rank 0, no graphs ran: the next bisect compares the two ranks' re-runs
    # (before: --between recorded,rerun, which finds nothing when the step reproduces; trial 21).
    assert "--step 5 --between rank:0,rank:1" in page, page[page.find("replay step"):][:400]
    assert "--between recorded,rerun" not in page and "eager,cudagraph" not in page and "--mode both" not in page


def test_report_of_one_rank_makes_no_verdict_across_ranks(tmp_path, run_cli):
    rec = make_recording(tmp_path, ranks=1, steps=3)
    page = Path(run_cli("report", rec).out.splitlines()[-1]).read_text()
    assert "No divergence" not in page and "<b>One rank</b>: nothing to compare across ranks" in page
    assert f"replay step {rec} --rank 0 --step 2" in page


def test_next_commands_name_a_factory_where_the_recording_has_none(diverged):
    """The page suggested `replay bisect layers ... --between recorded,rerun` for a recording
    with no factory, which that command then refused ("needs a factory"); the suggestion says
    it needs one, and leaves it out where the recording names one."""
    import dataclasses

    from replay.report.html import _next_commands

    rep = build_report(diverged)
    assert not rep.has_factory
    cmds = _next_commands(rep)
    assert "replay bisect layers" in cmds and "--factory MODULE:QUALNAME" in cmds, cmds
    assert "--factory" not in _next_commands(dataclasses.replace(rep, has_factory=True))


def test_no_token_field_is_not_called_the_same_tokens(tmp_path):
    """Ranks whose logits differ and who recorded no token field: the page said "No token
    divergence: the ranks ... sampled the same tokens" and "steps where tokens differ 0", where
    info (and the page's own JSON) said no token field was recorded."""
    import torch

    from replay import Recorder, RecorderConfig

    out = tmp_path / "rec"
    for rank in range(2):
        rec = Recorder(RecorderConfig(out=out, rank=rank, world_size=2))
        for s in range(4):
            rec.begin_step()
            logits = torch.arange(8.0).reshape(1, 8) + (1e-3 if rank == 1 and s >= 2 else 0.0)
            rec.record_outputs(logits=logits)
            rec.end_step()
        rec.close()
        assert rec.error is None
    rep = build_report(out)
    assert rep.summary["token_fields"] is False and rep.first_divergence is not None
    page = write_report(rep, tmp_path / "r.html").read_text()
    assert "sampled the same tokens" not in page and "No token field recorded" in page
    assert re.search(r"steps where tokens differ</div><div class=\"v\">not recorded", page), "the fact says not recorded"
