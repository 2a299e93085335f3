"""`replay.api`, the front door: the CLI's functions from Python, and the page that documents them."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import replay
from replay import api
from replay.errors import RecordingDamaged, UsageError
from replay.states import CheckState
from tests.factories import make_recording

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "python-api.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def test_the_documented_example_runs_and_prints_what_the_page_says(tmp_path: Path) -> None:
    rec = make_recording(tmp_path, ranks=4, steps=8, diverge_at=4, diverge_rank=2)
    blocks = _blocks(DOC.read_text())
    code = next(body for lang, body in blocks if lang == "python")
    said = next(body for i, (lang, body) in enumerate(blocks) if lang == "" and blocks[i - 1][1] == code)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"RECORDING": rec})  # noqa: S102 - our own documentation
    assert out.getvalue() == said


def test_every_public_name_resolves_and_the_root_only_reexports() -> None:
    for name in replay.__all__:
        assert getattr(replay, name) is not None, name
    assert set(api.__all__) <= set(replay.__all__)
    assert replay.info is api.info and replay.bisect_config is api.bisect_config


def test_import_replay_and_info_need_no_torch_nor_does_the_cli(tmp_path: Path) -> None:
    rec = make_recording(tmp_path, ranks=2, steps=3)
    code = ("import sys, replay, replay.states\n"
            f"with replay.open_recording({str(rec)!r}) as r:\n"
            "    replay.info(r); replay.verify(r, payload=False)\n"
            "from replay.cli.main import main\n"
            f"assert main(['info', {str(rec)!r}]) == 0 and main(['verify', '--quick', {str(rec)!r}]) == 0\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "False"


def test_info_result_is_what_info_json_prints(tmp_path: Path, run_cli) -> None:
    rec = make_recording(tmp_path, ranks=3, steps=5, diverge_at=2, diverge_rank=1, field="tokens")
    with replay.open_recording(rec) as r:
        res = replay.info(r)
    assert res.to_json() == run_cli("info", rec, "--json").json()
    assert (res.first_divergence["step"], res.first_divergence["ranks"]) == (2, [1])
    assert res.first_token_divergence["step"] == 2 and res.exit_code == 0
    assert [(p.name, p.diverged) for p in res.parts] == [("run-000", True)]


def test_verify_result_states_and_exit_codes(tmp_path: Path) -> None:
    rec = make_recording(tmp_path, ranks=2, steps=3)
    with replay.open_recording(rec) as r:
        ok = replay.verify(r)
    assert ok.state is CheckState.INTACT and ok.state == "intact" and ok.exit_code == 0 and str(ok) == "recording is intact"
    (rec / "run-000" / "rank-00001.h5").write_bytes(b"not hdf5")
    with replay.open_recording(rec) as r:
        bad = replay.verify(r)
    assert bad.state is CheckState.DAMAGED and bad.exit_code == RecordingDamaged.exit_code
    assert bad.to_json()["state"] == "damaged"


def test_bisect_steps_takes_a_part(tmp_path: Path) -> None:
    rec = make_recording(tmp_path, ranks=4, steps=8, diverge_at=5, diverge_rank=3)
    with replay.open_recording(rec) as r:
        part = replay.choose_part(r, None)
        res = replay.bisect_steps(part)
        assert (res.first, res.odd, res.majority, res.how) == (5, [3], [0, 1, 2], "ranks")
        assert replay.bisect_steps(part, ranks=[0, 1]).first is None
        with pytest.raises(UsageError):
            replay.bisect_steps(part, ranks=[0])


@pytest.mark.parametrize(
    "cmd, env, expect",
    [(["torchrun", "--node-rank", "3", "x.py"], {}, 3), (["torchrun", "--node_rank=2", "x.py"], {}, 2),
     (["python", "x.py"], {"NODE_RANK": "1"}, 1), (["python", "x.py"], {"SLURM_NODEID": "4"}, 4),
     (["torchrun", "--node-rank", "5"], {"NODE_RANK": "1"}, 5), (["python", "x.py"], {"NODE_RANK": "x"}, None)],
    ids=["flag", "flag=", "env", "slurm", "flag-wins", "not-a-number"],
)
def test_detect_node_rank(cmd: list[str], env: dict[str, str], expect: int | None) -> None:
    assert api.detect_node_rank(cmd, env) == expect


def test_make_recording_dir(tmp_path: Path) -> None:
    a = api.make_recording_dir(["python", "serve.py"], out=None, root=tmp_path / "recs")
    b = api.make_recording_dir(["python", "serve.py"], out=None, root=tmp_path / "recs")
    assert a != b and a.is_dir() and b.is_dir() and a.parent == tmp_path / "recs" and "serve" in a.name
    assert api.make_recording_dir(["x"], out=tmp_path / "given", root=tmp_path) == tmp_path / "given"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="cannot write the recording"):
        api.make_recording_dir(["x"], out=blocker / "sub", root=tmp_path)


def test_rerun_options_are_checked_where_they_enter() -> None:
    with pytest.raises(UsageError):
        api.RerunOptions(modes=("sideways",))
    with pytest.raises(UsageError):
        api.RerunOptions(repeat=0)
    assert api.RerunOptions().modes == ("eager",)


def test_version_from_one_place_installed_or_not(tmp_path: Path) -> None:
    from replay._version import __version__

    assert replay.__version__ == __version__
    text = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "replay._version.__version__" }' in text and 'dynamic = ["version"]' in text
    # From a directory where no installed `replay` is visible, only this checkout on PYTHONPATH.
    p = subprocess.run([sys.executable, "-m", "replay", "--version"], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"replay {__version__}", p.stderr
