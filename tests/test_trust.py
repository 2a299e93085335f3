"""The trust model (docs/security.md): a re-run imports only what the user chose or accepted."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest

from replay import Recorder, RecorderConfig, trust
from replay.errors import FactoryError, UntrustedRecording
from replay.format.reader import Recording
from tests.factories import step_inputs, step_logits

EVIL = '''
import os
open(os.environ["REPLAY_EVIL_MARKER"], "a").write("imported\\n")

def build(config, *, rank, world_size, device, options):
    open(os.environ["REPLAY_EVIL_MARKER"], "a").write("called\\n")
    raise RuntimeError("evil factory ran")
'''

EXITING = '''
def build(config, *, rank, world_size, device, options):
    raise SystemExit(3)

def interrupted(config, *, rank, world_size, device, options):
    raise KeyboardInterrupt
'''


@pytest.fixture(autouse=True)
def key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A signing key of this test's own, and no consent left over from another test."""
    path = tmp_path / "config" / "replay" / "key"
    monkeypatch.setenv(trust.ENV_KEY_FILE, str(path))
    monkeypatch.delenv(trust.ENV_ACCEPTED, raising=False)
    return path


@pytest.fixture
def evil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    d = tmp_path / "evil"
    d.mkdir()
    (d / "evil_factory.py").write_text(EVIL)
    (d / "exiting_factory.py").write_text(EXITING)
    marker = tmp_path / "marker.txt"
    monkeypatch.setenv("REPLAY_EVIL_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(d))
    for m in ("evil_factory", "exiting_factory"):
        sys.modules.pop(m, None)
    yield {"dir": d, "marker": marker}
    for m in ("evil_factory", "exiting_factory"):
        sys.modules.pop(m, None)


def record(out: Path, target: dict[str, Any], *, ranks: int = 1, steps: int = 3) -> Path:
    """A recording made by this user's recorder (signed when it seals), naming ``target``."""
    for r in range(ranks):
        rec = Recorder(RecorderConfig(out=out, part="run-000", rank=r, world_size=ranks, keyframe_every=0, ring=0))
        rec.set_target(target)
        for s in range(steps):
            rec.begin_step()
            rec.record_inputs(**step_inputs(s))
            rec.record_outputs(logits=step_logits(s))
            rec.end_step()
        rec.close()
        assert rec.error is None, rec.error
    return out


def edit_target(rec: Path, target: dict[str, Any], rank: int = 0) -> None:
    with h5py.File(rec / "run-000" / f"rank-{rank:05d}.h5", "r+") as h:
        h.attrs["target"] = json.dumps(target)


STEP = ["--rank", "0", "--step", "1", "--mode", "eager", "--device", "cpu", "--no-save"]
EVIL_TARGET = {"step": "evil_factory:Engine.step", "factory": "evil_factory:build", "config": {}}


def test_key_is_private_and_created_once(key: Path, tmp_path: Path) -> None:
    record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    first = key.read_bytes()
    record(tmp_path / "rec2", {"step": "m:E.step", "factory": "m:build", "config": {}})
    assert key.read_bytes() == first
    sig = json.loads((tmp_path / "rec" / "run-000" / "rank-00000.sig").read_text())
    assert first.strip().decode() not in json.dumps(sig), "the key itself must never be written into a recording"


def test_own_recording_is_signed_and_any_edit_breaks_it(tmp_path: Path) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {"width": 8}})
    h5 = rec / "run-000" / "rank-00000.h5"
    with Recording(rec) as r:
        assert trust.rank_signature_ok(h5, r["run-000"][0].attrs["target"]) is None
    # The factory's config is data a factory acts on (paths, sizes): it is signed too.
    edit_target(rec, {"step": "m:E.step", "factory": "m:build", "config": {"width": 9}})
    with Recording(rec) as r:
        assert trust.rank_signature_ok(h5, r["run-000"][0].attrs["target"]) == "it changed after it was signed"


def test_edited_recording_is_refused_with_what_and_where(evil: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    edit_target(rec, EVIL_TARGET)
    res = run_cli("step", rec, *STEP)
    lines = res.err.strip().splitlines()
    assert res.code == UntrustedRecording.exit_code == 8 and len(lines) == 1, res
    line = lines[0]
    assert line.startswith("replay: error: run-000 rank 0 of") and "evil_factory:build" in line, line
    assert str(evil["dir"] / "evil_factory.py") in line, "the line says where the module would come from"
    assert "changed after it was signed" in line and "--trust" in line and "trusted = [...]" in line, line
    assert not evil["marker"].exists(), "nothing was imported"
    # bisect re-runs too, and says the same before importing anything.
    res = run_cli("bisect", rec, "--rank", "0", "--step", "1", "--between", "eager,eager", "--device", "cpu", "--no-save")
    assert res.code == 8 and "evil_factory:build" in res.err, res
    res = run_cli("bisect", rec, "--steps", "--against-rerun", "--rank", "0", "--device", "cpu", "--no-save")
    assert res.code == 8 and "evil_factory:build" in res.err, res
    assert not evil["marker"].exists()
    # Reading commands never look at it at all.
    assert run_cli("info", rec).code == 0 and not evil["marker"].exists()


def test_trust_flag_is_consent(evil: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    edit_target(rec, EVIL_TARGET)
    res = run_cli("step", rec, *STEP, "--trust")
    assert res.code == FactoryError.exit_code and "evil factory ran" in res.err, res
    assert evil["marker"].read_text().split() == ["imported", "called"]


def test_signed_recording_runs_without_prompt(evil: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    """Made by this user on this machine and unchanged: no --trust needed."""
    rec = record(tmp_path / "rec", EVIL_TARGET)
    res = run_cli("step", rec, *STEP)
    assert res.code == FactoryError.exit_code and "evil factory ran" in res.err, res
    assert "called" in evil["marker"].read_text()
    # bisect says what it imports, and from where, before it does.
    res = run_cli("bisect", rec, "--rank", "0", "--step", "1", "--between", "eager,eager", "--device", "cpu", "--no-save")
    assert f"importing evil_factory:build (from {evil['dir'] / 'evil_factory.py'})" in res.err, res


def test_another_users_key_fails_the_check(evil: dict[str, Path], tmp_path: Path, run_cli: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rec = record(tmp_path / "rec", EVIL_TARGET)
    monkeypatch.setenv(trust.ENV_KEY_FILE, str(tmp_path / "other-user" / "key"))
    trust._key(create=True)
    res = run_cli("step", rec, *STEP)
    assert res.code == 8 and "signed by another user or on another machine" in res.err, res
    assert not evil["marker"].exists()


def test_allow_list_in_the_users_pyproject(evil: dict[str, Path], tmp_path: Path, run_cli: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    edit_target(rec, EVIL_TARGET)
    # A pyproject.toml inside the recording cannot vouch for the recording.
    (rec / "pyproject.toml").write_text('[tool.replay]\ntrusted = ["evil_factory"]\n')
    monkeypatch.chdir(rec)
    res = run_cli("step", rec, *STEP)
    assert res.code == 8 and not evil["marker"].exists(), res
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.replay]\ntrusted = ["evil_factory"]\n')
    monkeypatch.chdir(project)
    res = run_cli("step", rec, *STEP)
    assert res.code == FactoryError.exit_code and "called" in evil["marker"].read_text(), res


def test_factory_on_the_command_line_is_the_users_choice(evil: dict[str, Path], tmp_path: Path, run_cli: Any) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    edit_target(rec, {"step": "m:E.step", "factory": "elsewhere:build", "config": {}})
    res = run_cli("step", rec, *STEP, "--factory", "evil_factory:build")
    assert res.code == FactoryError.exit_code and "evil factory ran" in res.err, res


def test_module_inside_the_recording_is_not_imported(evil: dict[str, Path], tmp_path: Path, run_cli: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A .py shipped beside the recording, with the recording on sys.path (``python -m replay
    step .`` run inside it): even a signed name is not imported from there without --trust."""
    rec = record(tmp_path / "rec", {"step": "shipped:Engine.step", "factory": "shipped:build", "config": {}})
    (rec / "shipped.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(rec))
    sys.modules.pop("shipped", None)
    res = run_cli("step", rec, *STEP)
    assert res.code == FactoryError.exit_code and "cannot import shipped" in res.err, res
    assert not evil["marker"].exists()
    assert str(rec) not in sys.path, "the recording's directory was taken off sys.path"
    sys.modules.pop("shipped", None)


@pytest.mark.parametrize("name, exc", [("build", "SystemExit"), ("interrupted", "KeyboardInterrupt")])
def test_factory_that_exits_is_contained(evil: dict[str, Path], tmp_path: Path, run_cli: Any, name: str, exc: str) -> None:
    rec = record(tmp_path / "rec", {"step": "x:Engine.step", "factory": f"exiting_factory:{name}", "config": {}})
    res = run_cli("step", rec, *STEP)
    errors = [ln for ln in res.err.strip().splitlines() if ln.startswith("replay: error:")]
    assert res.code == FactoryError.exit_code and len(errors) == 1 and exc in errors[0], res
    assert "Traceback" not in res.err


def test_seal_signs_only_what_this_user_started(tmp_path: Path, run_cli: Any) -> None:
    """A crashed journal sealed by hand is signed only in a recording this user's `replay record`
    started: sealing someone else's crashed recording must not make it trusted."""
    import shutil

    from replay.format.manifest import write_manifest

    def crashed(out: Path) -> Path:
        rec = Recorder(RecorderConfig(out=out / "live", part="run-000", rank=0, world_size=1, keyframe_every=0, ring=0))
        rec.set_target({"step": "m:E.step", "factory": "m:build", "config": {}})
        rec.begin_step()
        rec.record_inputs(**step_inputs(0))
        rec.end_step()
        rec.drain()  # the journal lags the record ring; copy it once it holds the step
        (out / "copy" / "run-000").mkdir(parents=True)
        for ext in ("journal", "payload"):
            shutil.copy(out / "live" / "run-000" / f"rank-00000.{ext}", out / "copy" / "run-000" / f"rank-00000.{ext}")
        rec.close()
        return out / "copy"

    foreign = crashed(tmp_path / "a")
    write_manifest(foreign, {"command": ["x"], "started_at": 0.0})
    assert run_cli("seal", foreign).code == 0
    assert (foreign / "run-000" / "rank-00000.h5").exists() and not (foreign / "run-000" / "rank-00000.sig").exists()

    mine = crashed(tmp_path / "b")
    assert trust.sign_manifest(write_manifest(mine, {"command": ["x"], "started_at": 0.0}))
    assert run_cli("seal", mine).code == 0
    with Recording(mine) as r:
        assert trust.rank_signature_ok(mine / "run-000" / "rank-00000.h5", r["run-000"][0].attrs["target"]) is None


def test_unreadable_key_is_not_used(key: Path, tmp_path: Path) -> None:
    rec = record(tmp_path / "rec", {"step": "m:E.step", "factory": "m:build", "config": {}})
    os.chmod(key, 0o644)  # readable by others: not a secret any more
    with Recording(rec) as r:
        why = trust.rank_signature_ok(rec / "run-000" / "rank-00000.h5", r["run-000"][0].attrs["target"])
    assert why == "there is no signing key here"


def test_locate_runs_no_code(evil: dict[str, Path]) -> None:
    """Saying where a module would come from never imports it (nor its package's __init__)."""
    pkg = evil["dir"] / "evilpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(EVIL)
    (pkg / "sub.py").write_text(EVIL)
    assert trust.locate("evilpkg.sub") == str(pkg / "sub.py")
    assert trust.locate("evil_factory") == str(evil["dir"] / "evil_factory.py")
    assert trust.locate("no_such_module_xyz") == "not found"
    assert not evil["marker"].exists() and "evilpkg" not in sys.modules
    with pytest.raises(UntrustedRecording):
        trust.check(evil["dir"], ["evilpkg.sub:build"], signed="it is not signed")
    assert not evil["marker"].exists()


def test_trust_reaches_the_processes_a_rerun_starts(tmp_path: Path) -> None:
    """--trust in the CLI process is consent in the probe and per-rank processes it starts (they
    inherit the environment), for that recording only."""
    import subprocess

    rec = tmp_path / "rec"
    rec.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    trust.accept(rec)
    code = "import sys; from pathlib import Path; from replay import trust; print(trust.accepted(Path(sys.argv[1])), trust.accepted(Path(sys.argv[2])))"
    out = subprocess.run([sys.executable, "-c", code, str(rec), str(other)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)), check=True)
    assert out.stdout.split() == ["True", "False"]
