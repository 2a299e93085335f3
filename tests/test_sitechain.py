"""``replay.sitechain``: the bootstraps of ``replay record`` and ``replay step`` hand over to the
environment's own ``sitecustomize``, and leave ``sys.path`` and the bootstrap's module as they were."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from replay.sitechain import run_next

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A bootstrap directory and an environment directory, each with a sitecustomize, first on
    ``sys.path``; the bootstrap's module is the one imported as ``sitecustomize``."""
    ours, env = tmp_path / "bootstrap", tmp_path / "env"
    ours.mkdir()
    env.mkdir()
    (ours / "sitecustomize.py").write_text("raise AssertionError('the bootstrap must not be imported again')\n")
    monkeypatch.syspath_prepend(str(env))
    monkeypatch.syspath_prepend(str(ours))
    bootstrap_module = types.ModuleType("sitecustomize")
    monkeypatch.setitem(sys.modules, "sitecustomize", bootstrap_module)
    return ours, env, bootstrap_module


def test_the_environments_sitecustomize_runs_after_ours(sites, tmp_path: Path) -> None:
    ours, env, bootstrap_module = sites
    marker = tmp_path / "ran"
    (env / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('env')\n")
    path_before = list(sys.path)
    run_next(str(ours))
    assert marker.read_text() == "env"
    assert sys.path == path_before
    assert sys.modules["sitecustomize"] is bootstrap_module


def test_a_failing_environment_sitecustomize_is_one_line(sites, capsys: pytest.CaptureFixture[str]) -> None:
    ours, env, bootstrap_module = sites
    (env / "sitecustomize.py").write_text("raise RuntimeError('cluster hook broke')\n")
    path_before = list(sys.path)
    run_next(str(ours))
    assert capsys.readouterr().err == "replay: the environment's own sitecustomize failed: cluster hook broke\n"
    assert sys.path == path_before
    assert sys.modules["sitecustomize"] is bootstrap_module


@pytest.mark.e2e
@pytest.mark.parametrize("bootstrap", ["record", "rerun"])
def test_each_bootstrap_hands_over(bootstrap: str, tmp_path: Path) -> None:
    """The real bootstrap files, as `replay record` / `replay step` inject them (no recording or
    re-run asked for): the environment's sitecustomize still runs, the program is unchanged."""
    env_site = tmp_path / "env"
    env_site.mkdir()
    marker = tmp_path / "ran"
    (env_site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('env')\n")
    boot = ROOT / "replay" / bootstrap / "bootstrap"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(boot), str(ROOT), str(env_site)])
    proc = subprocess.run([sys.executable, "-c", "import sitecustomize; print(sitecustomize.__file__)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(boot / "sitecustomize.py")
    assert marker.read_text() == "env"
    assert proc.stderr == ""
