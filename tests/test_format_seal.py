"""`replay.format.seal`: a journal a dead process left becomes an HDF5 index over the same payload,
once, atomically; a live journal is never sealed."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.format.reader import Recording
from replay.format.seal import journal_is_live, rank_paths, seal_part, seal_rank

ROOT = Path(__file__).resolve().parents[1]

# Records three steps of one rank, then dies without closing: what a SIGKILL leaves.
_KILLED = """
import os, sys, torch
from pathlib import Path
from replay import Recorder, RecorderConfig
rec = Recorder(RecorderConfig(out=Path(sys.argv[1]), rank=0, world_size=1))
for s in range(3):
    rec.begin_step()
    rec.record_inputs(x=torch.full((2,), float(s)))
    rec.record_outputs(logits=torch.arange(4.0) + s)
    rec.end_step()
os._exit(0)
"""


@pytest.fixture(scope="module")
def _killed_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("seal") / "rec"
    p = subprocess.run([sys.executable, "-c", _KILLED, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr
    # The rank's drain process outlives it until the ring is in the journal, and holds the
    # journal's lock meanwhile (`replay seal` waits for it the same way): copying the part
    # before would copy a journal that is still growing.
    journal, _, _ = rank_paths(out / "run-000", 0)
    deadline = time.monotonic() + 60
    while journal_is_live(journal) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not journal_is_live(journal), "the killed rank's drain process did not end"
    return out


@pytest.fixture
def killed(_killed_once: Path, tmp_path: Path) -> Path:
    """A fresh copy of the killed rank's part, for each test to seal."""
    shutil.copytree(_killed_once, tmp_path / "rec")
    return tmp_path / "rec" / "run-000"


def test_sealing_a_killed_rank_keeps_every_completed_step_once(killed: Path) -> None:
    journal, payload, h5 = rank_paths(killed, 0)
    assert journal.exists() and not h5.exists() and not journal_is_live(journal)
    payload_bytes = payload.read_bytes()
    results = seal_part(killed)
    assert [(r.rank, r.steps, r.complete, r.error) for r in results] == [(0, 3, False, None)]
    assert h5.exists() and not journal.exists() and not journal.with_suffix(".reserve").exists()
    assert payload.read_bytes().startswith(payload_bytes)  # indexed in place: what was written stays (a salvaged ring is appended)
    assert seal_part(killed) == []  # nothing left to seal
    with Recording(killed.parent) as rec:
        rf = rec["run-000"][0]
        assert rf.sealed and not rf.live and rf.n_steps == 3 and not rf.complete
        assert [int(v) for v in rf.step(2).inputs["x"]] == [2, 2]


def test_a_journal_cut_mid_frame_seals_what_is_whole_and_says_what_was_lost(killed: Path) -> None:
    journal, _, _ = rank_paths(killed, 0)
    size = journal.stat().st_size
    os.truncate(journal, size - 5)
    (r,) = seal_part(killed)
    assert r.error is None and r.problem and "cut short" in r.problem and r.lost_bytes > 0
    assert 0 <= r.steps < 3


def test_a_live_journal_is_not_sealed(killed: Path) -> None:
    journal, _, h5 = rank_paths(killed, 0)
    fd = os.open(journal, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what the recording process holds while it runs
        assert journal_is_live(journal)
        assert seal_rank(killed, 0) is None and seal_part(killed) == []
        assert journal.exists() and not h5.exists()
    finally:
        os.close(fd)
    assert not journal_is_live(journal) and seal_rank(killed, 0) is not None


def test_a_journal_that_cannot_be_sealed_is_kept_and_named(killed: Path) -> None:
    journal, _, h5 = rank_paths(killed, 0)
    h5.mkdir()  # something in the way of the sealed file
    (r,) = seal_part(killed)
    assert r.error and journal.exists()  # one bad rank never loses its journal


def test_an_empty_journal_beside_a_sealed_rank_file_is_never_sealed_over_it(killed: Path) -> None:
    journal, _, h5 = rank_paths(killed, 0)
    seal_part(killed)
    assert h5.exists() and not journal.exists()
    # What a second writer that failed to start leaves (its payload existed): an empty journal.
    # Before: sealing it replaced the rank's 3 steps with 0.
    journal.touch()
    (r,) = seal_part(killed)
    assert r.error and "sealed already" in r.error and journal.exists()
    with Recording(killed.parent) as rec:
        assert rec["run-000"][0].n_steps == 3
