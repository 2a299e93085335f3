"""``bisect steps`` over several models in one loop (draft and target): the step it reports is
named with its stream and its index in that stream, as ``replay info`` names it, each stream's own
first divergence is noted, and ``--stream NAME`` bisects one stream's steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replay.bisect.steps import bisect_steps
from replay.errors import UsageError
from replay.format.reader import Recording
from tests.test_info import _streams_recording


@pytest.fixture()
def rec(tmp_path: Path) -> Path:
    # T D D T D D ...: step 5 is the draft's step 3; the target's first divergent step is 6 (its step 2).
    return _streams_recording(tmp_path, diverge_rank=1, diverge_step=5)


def test_the_step_found_is_named_with_its_stream(rec: Path) -> None:
    with Recording(rec) as r:
        res = bisect_steps(r["run-000"])
    assert (res.first, res.stream, res.stream_step, res.field) == (5, "draft", 3, "output.logits")
    assert res.verdict().startswith("ranks 0, 1 first disagree at step 5 (stream draft, its step 3; output.logits: rank 1 against 0)")
    assert "stream target: first disagrees at step 6 (its step 2, output.logits)" in res.notes
    assert "stream draft: first disagrees at step 5 (its step 3, output.logits)" in res.notes
    assert res.to_json()["stream"] == "draft" and res.to_json()["stream_step"] == 3


def test_one_stream_is_bisected_on_its_own_steps(rec: Path) -> None:
    with Recording(rec) as r:
        res = bisect_steps(r["run-000"], stream="target")
        assert (res.first, res.stream, res.stream_step, res.only_stream) == (6, "target", 2, "target")
        assert res.verdict().startswith("stream target: ranks 0, 1 first disagree at step 6")
        with pytest.raises(UsageError, match="no stream 'nope' \\(streams: target, draft\\)"):
            bisect_steps(r["run-000"], stream="nope")


def test_the_cli_names_the_stream_and_refuses_an_unknown_one(rec: Path, run_cli: Any) -> None:
    p = run_cli("bisect", "steps", rec, "--no-save")
    assert p.code == 0 and "at step 5 (stream draft, its step 3;" in p.out, p.out
    p = run_cli("bisect", "steps", rec, "--no-save", "--stream", "target")
    assert p.code == 0 and "at step 6 (stream target, its step 2;" in p.out, p.out
    p = run_cli("bisect", "steps", rec, "--no-save", "--stream", "nope")
    assert p.code != 0 and "no stream 'nope'" in p.err and "Traceback" not in p.err
