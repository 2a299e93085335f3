"""Recordings handed over by someone else, and directories shared with them: what a command
writes never leaves the recording, recordings are private by default, the default recording is
chosen by when it started, and `replay record` never shares an --out by accident."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from replay.errors import RecordingDamaged
from replay.format import perms
from replay.format.manifest import write_manifest
from replay.format.reader import Recording, resolve_recording
from replay.format.results import save_result
from tests.factories import make_recording

REPO = Path(__file__).resolve().parent.parent


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(autouse=True)
def _private(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(perms.ENV_PERMISSIONS, raising=False)


# -- permissions -------------------------------------------------------------------------------


def test_recordings_are_owner_only_by_default(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        rec = make_recording(tmp_path, ranks=2, steps=2)
        assert os.umask(0o022) == 0o022, "the umask is never changed"
    finally:
        os.umask(old)
    files = [p for p in rec.rglob("*") if p.is_file()]
    assert any(p.suffix == ".h5" for p in files) and any(p.suffix == ".payload" for p in files)
    assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}
    dirs = [p for p in rec.rglob("*") if p.is_dir()]
    assert dirs and {p.name: _mode(p) for p in dirs} == {p.name: 0o700 for p in dirs}
    saved = save_result(rec, {"kind": "step", "rank": 0, "step": 1})
    assert saved is not None and _mode(saved) == 0o600 and _mode(saved.parent) == 0o700


def test_journals_are_owner_only_while_recording(tmp_path: Path) -> None:
    from replay import Recorder, RecorderConfig

    rec = Recorder(RecorderConfig(out=tmp_path / "rec", part="run-000", rank=0, world_size=1, keyframe_every=0, ring=0))
    try:
        part = tmp_path / "rec" / "run-000"
        live = [p for p in part.iterdir() if p.suffix in (".journal", ".payload", ".reserve")]
        assert len(live) == 3 and all(_mode(p) == 0o600 for p in live), [(p.name, oct(_mode(p))) for p in live]
    finally:
        rec.close()


def test_group_permissions_widen_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(perms.ENV_PERMISSIONS, "group")
    old = os.umask(0o077)  # even under a strict umask: the mode is set explicitly
    try:
        rec = make_recording(tmp_path, ranks=1, steps=2)
    finally:
        os.umask(old)
    assert all(_mode(p) == 0o640 for p in rec.rglob("*") if p.is_file())
    assert all(_mode(p) == 0o750 for p in rec.rglob("*") if p.is_dir())


# -- nothing written through a link out of the recording -------------------------------------------


def test_results_symlink_is_not_followed(tmp_path: Path) -> None:
    rec = make_recording(tmp_path, ranks=2, steps=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (rec / "results").symlink_to(outside)
    assert save_result(rec, {"kind": "step", "rank": 0, "step": 1}) is None
    assert list(outside.iterdir()) == []


def test_result_file_symlink_is_not_followed(tmp_path: Path) -> None:
    from replay.format.results import write_inside

    rec = make_recording(tmp_path, ranks=1, steps=2)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (rec / "results").mkdir()
    (rec / "results" / "x.json").symlink_to(victim)
    write_inside(rec, "x.json", b"{}")  # replaces the link itself, never writes through it
    assert victim.read_text() == "keep" and not (rec / "results" / "x.json").is_symlink()


def test_bisect_state_neither_read_nor_written_through_a_link(tmp_path: Path) -> None:
    from replay.bisect.state import BisectState

    rec = make_recording(tmp_path, ranks=1, steps=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    key = {"rank": 0, "step": 1}
    planted = BisectState(outside.parent / "planted", key)
    (rec / "results").symlink_to(outside)
    (outside / planted.path.name).write_text(json.dumps({"kind": "bisect-state", "version": 1, "key": key,
                                                         "baseline": "planted", "probes": {"a": 1}, "done": True}))
    state = BisectState(rec, key)
    assert not state.resumed and state.data["baseline"] is None, "the state was read from outside the recording"
    state.save()
    assert not state.writable and [p.name for p in outside.iterdir()] == [planted.path.name]


def test_bisect_steps_saves_nothing_outside(tmp_path: Path, run_cli: Any) -> None:
    rec = make_recording(tmp_path, ranks=2, steps=3, diverge_at=1, diverge_rank=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (rec / "results").symlink_to(outside)
    res = run_cli("bisect", rec, "--steps")
    assert res.code == 0, res
    assert list(outside.iterdir()) == []


# -- the default recording ---------------------------------------------------------------------


def test_default_is_newest_by_start_time_not_name(tmp_path: Path) -> None:
    root = tmp_path / "recordings"
    real = make_recording(root, ranks=1, steps=2, name="20261201-100000-real")
    write_manifest(real, {"started_at": time.time()})
    planted = make_recording(root, ranks=1, steps=2, name="99999999-999999-planted")
    write_manifest(planted, {"started_at": time.time() - 3600})
    assert resolve_recording(None, root) == (real, True)
    # A start time in the future (later than the manifest file itself) is not believed.
    write_manifest(planted, {"started_at": time.time() + 10 ** 9})
    os.utime(planted / "manifest.json", (time.time() - 7200, time.time() - 7200))
    write_manifest(real, {"started_at": time.time()})
    assert resolve_recording(None, root)[0] == real


def test_recording_still_starting_says_so(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    rec.mkdir()
    write_manifest(rec, {"command": ["python", "x.py"], "started_at": time.time(), "status": "recording"})
    with pytest.raises(RecordingDamaged, match="no rank has started recording yet") as e:
        Recording(rec)
    assert "ended before" not in str(e.value)
    write_manifest(rec, {"command": ["python", "x.py"], "started_at": time.time(), "status": "complete", "exit_code": 3})
    with pytest.raises(RecordingDamaged, match="ended before any rank started recording"):
        Recording(rec)


# -- replay record --out -----------------------------------------------------------------------


def _record(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "replay", "record", "--quiet", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_out_holding_a_recording_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    # (a recording with a step in it: one where nothing was recorded is replaced)
    first = _record("--out", str(out), "--", sys.executable, "-c",
                    "import torch; m = torch.nn.Linear(2, 2)\nfor _ in range(3): m(torch.ones(1, 2))", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert _mode(out) == 0o700 and _mode(out / "manifest.json") == 0o600
    marker = tmp_path / "ran"
    again = _record("--out", str(out), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", cwd=tmp_path)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1 and "already holds a recording" in lines[0] and "--add" in lines[0], again.stderr
    assert not marker.exists(), "the command did not run"
    # Another node of the same multi-node run writes its own manifest there.
    node = _record("--out", str(out), "--node-rank", "1", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert node.returncode == 0 and (out / "manifest.node1.json").exists(), node.stderr
    added = _record("--out", str(out), "--add", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", cwd=tmp_path)
    assert added.returncode == 0 and marker.exists(), added.stderr


def test_running_unrecorded_is_the_users_choice(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "rec"  # under a file: cannot be created
    marker = tmp_path / "ran"
    cmd = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    res = _record("--out", str(out), *cmd, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "was not run" in lines[0] and "--run-anyway" in lines[0], res.stderr
    assert not marker.exists()
    res = _record("--out", str(out), "--run-anyway", *cmd, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 0 and marker.exists(), res.stderr
    assert len(lines) == 1 and "running" in lines[0] and "unrecorded" in lines[0], res.stderr


def test_a_saved_result_is_named_by_what_it_has(tmp_path):
    """A result of one rank and step names them; one of neither (a bisection over all steps of
    all ranks) names neither, never ``rNone``/``sNone``."""
    from replay.format.results import save_result

    (tmp_path / "results").mkdir()
    one = save_result(tmp_path, {"kind": "step", "rank": 3, "step": 10})
    none = save_result(tmp_path, {"kind": "bisect-steps", "rank": None, "step": None})
    assert one is not None and one.name.startswith("step-r3-s10-")
    assert none is not None and none.name.startswith("bisect-steps-2") and "None" not in none.name
