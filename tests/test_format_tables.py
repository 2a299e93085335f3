"""`replay.format.tables`: one in-memory model of a rank, whether read from a live journal or a
sealed file, and a consistency check that refuses what a damaged file would hand every reader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from replay import Recorder, RecorderConfig
from replay.format.reader import Recording
from replay.format.tables import StringTable, check_payload_bounds, combine_digests
from tests.factories import make_recording, step_inputs, step_logits


def test_combine_digests_is_order_sensitive_and_stable() -> None:
    ds = [0x1234, 0xFFFFFFFFFFFFFFFF, 0]
    assert combine_digests(ds) == combine_digests(list(ds)) and combine_digests(ds) != combine_digests(ds[::-1])
    assert combine_digests([]) == 0 and combine_digests([0]) != combine_digests([0, 0])
    assert 0 <= combine_digests(ds) < 1 << 64


def test_string_table_interns_and_never_raises_on_a_bad_id() -> None:
    st = StringTable(["a"])
    assert (st("a"), st("b"), st("b")) == (0, 1, 1) and st.strings == ["a", "b"]
    assert (st.get(1), st.get(7), st.get(-1)) == ("b", "", "")


def test_a_live_journal_reads_as_a_prefix_of_the_sealed_file(tmp_path: Path) -> None:
    """Read a rank while it records, then the file sealed from it: the live view is a whole
    prefix of the final one, row for row (what `info` shows of a live run stays true afterwards)."""
    out = tmp_path / "rec"
    rec = Recorder(RecorderConfig(out=out, rank=0, world_size=1, keyframe_every=2), state_fn=lambda: {"kv": torch.ones(2)})
    for s in range(4):
        rec.begin_step()
        rec.record_inputs(**step_inputs(s))
        rec.record_outputs(logits=step_logits(s), tokens=step_logits(s).argmax(-1))
        rec.end_step()
    with Recording(out) as r:  # as `replay info` reads a live run
        rf = r["run-000"][0]
        assert rf.live
        live = rf.full()
    rec.close()
    assert rec.error is None
    with Recording(out) as r:
        sealed = r["run-000"][0].full()
    n = int(live.steps.size)
    assert sealed.steps.size == 4 and n <= 4
    assert np.array_equal(live.steps, sealed.steps[:n])
    cols = ("step", "order", "digest")
    lf, sf = live.fields, sealed.fields
    assert np.array_equal(lf[list(cols)][lf["step"] < n], sf[list(cols)][sf["step"] < n])
    assert [live.string(int(i)) for i in lf["field"][lf["step"] < n]] == [sealed.string(int(i)) for i in sf["field"][sf["step"] < n]]
    check_payload_bounds(live)
    check_payload_bounds(sealed)


@pytest.fixture
def tables(tmp_path: Path):
    rec = make_recording(tmp_path, ranks=1, steps=3)
    with Recording(rec) as r:
        return r["run-000"][0].full()


def _with(t, table: str, column: str, value: int):
    rows = getattr(t, table).copy()
    rows[column][0] = value
    return dataclasses.replace(t, **{table: rows})


@pytest.mark.parametrize("table, column, value, words", [
    ("tensors", "offset", 1 << 40, "beyond the end of the payload"),
    ("tensors", "nbytes", -5, "beyond the end of the payload"),
    ("fields", "field", 10_000, "names a string that is not in /strings"),
    ("steps", "step", -3, "a negative step"),
    ("fields", "step", 1 << 62, "outside the recorded steps"),
], ids=["offset", "nbytes", "string-id", "negative-step", "huge-step"])
def test_inconsistent_tables_are_refused_as_damage(tables, table: str, column: str, value: int, words: str) -> None:
    check_payload_bounds(tables)  # as written: consistent
    if table == "tensors":
        first_stored = int(np.flatnonzero(tables.tensors["offset"] >= 0)[0])
        rows = tables.tensors.copy()
        rows[column][first_stored] = value
        bad = dataclasses.replace(tables, tensors=rows)
    else:
        bad = _with(tables, table, column, value)
    with pytest.raises(ValueError, match=words):
        check_payload_bounds(bad)
