"""``replay bisect layers --between run:A,run:B``: two recordings of one small model, one with a
single weight changed (``block.mix.weight[3, 5] += 1e-2``), compared module by module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replay import api
from replay.format.reader import Recording

ROOT = Path(__file__).resolve().parents[1]
RERUN_ERROR, USAGE = 7, 2
STEPS = 6

pytestmark = pytest.mark.e2e  # recordings made by `replay record` in subprocesses: `make test-e2e`


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    jobs = {}
    for name, bump in (("a", "0"), ("b", "0.01")):
        cmd = [sys.executable, "-m", "replay", "record", "--out", str(base / name), "--quiet", "--keyframe-every", "2",
               "--step", "tests.runs_engine:Net", "--config", "replay_config", "--factory", "tests.runs_engine:build",
               "--", sys.executable, "-m", "tests.runs_engine", str(STEPS), bump]
        jobs[name] = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, p in jobs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, (name, err.decode()[-2000:])
    shutil.copytree(base / "a", base / "a2")  # the same run twice: nothing may differ
    return {name: base / name for name in ("a", "b", "a2")}


def _bisect(run_cli: Any, *args: Any) -> Any:
    return run_cli("bisect", "layers", *args, "--no-save")


def test_the_changed_weight_is_named_with_the_module_that_makes_the_difference(runs, run_cli):
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}", "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["step"] == 0  # the first step where the recorded bits of the two runs differ
    assert data["first"] == "block.mix" and data["maker"] == "block.mix"
    assert data["parameters_differ"] == ["block.mix.weight"]
    mods = {m["name"]: m for m in data["modules"]}
    assert mods["embed"]["verdict"] == "bitwise equal" and mods["block.norm"]["verdict"] == "bitwise equal"
    assert mods["block.mix"]["inputs_equal"] is True and mods["block.mix"]["verdict"] != "bitwise equal"
    assert [s["where"] for s in data["sides"]] == [f"{runs['a']}:run-000/0", f"{runs['b']}:run-000/0"]

    text = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}")
    assert text.code == 0, text.err
    head = text.out.splitlines()[0]
    assert head.startswith("step 0, run A (") and "first module that differs: block.mix" in head
    assert "its parameters differ between the runs: block.mix.weight" in head


def test_diff_names_the_bisection_to_run_next(runs, run_cli):
    res = run_cli("diff", runs["a"], runs["b"], "--json")
    assert res.code == 1
    assert res.json()["next"] == f"replay bisect layers --between run:{runs['a']}:run-000/0,run:{runs['b']}:run-000/0 --step 0"
    assert run_cli("diff", runs["a"], runs["b"]).out.splitlines()[-1].startswith("next: replay bisect layers --between run:")


def test_run_against_run_b_alone_and_a_later_step(runs, run_cli):
    """RUN is run A (rank from --rank); at step 3 the carried-over state already differs, so no
    module makes the difference from equal inputs, and the verdict says so instead of naming one."""
    res = _bisect(run_cli, runs["a"], "--rank", 0, "--step", 3, "--between", f"run:{runs['b']}:run-000/0", "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["step"] == 3 and data["maker"] is None and data["first"] == "block.norm"
    assert data["equal_inputs"]["maker"] is None  # the catch-up from step 2 with B's model already changed the state
    assert data["modules"][0]["verdict"] == "bitwise equal"  # embed: the step's inputs are the same
    text = _bisect(run_cli, runs["a"], "--step", 3, "--between", f"run:{runs['b']}")
    assert "no module turns bitwise equal inputs into different outputs" in text.out.splitlines()[0]


def test_from_equal_inputs_run_b_s_model_on_run_a_s_data(runs, run_cli):
    """At step 2 (a keyframe) the carried-over state differs between the runs, so no module has
    equal inputs on both; run B's model re-run from run A's keyframe and inputs does, and the
    module whose weight was changed is named first."""
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}", "--step", 2, "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["maker"] is None and data["first"] == "block.norm"
    sub = data["equal_inputs"]
    assert sub["maker"] == "block.mix" and sub["sides"][1]["label"] == "run B's model on run A's data"
    assert [m["inputs_equal"] for m in sub["modules"][:3]] == [True, True, True]
    out = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}", "--step", 2).out
    head = out.splitlines()[0]
    assert "\nfrom equal inputs: step 2, run A (" in out and "block.mix receives bitwise equal inputs" in out
    assert "from equal inputs (run B's model on run A's data) the difference is made in block.mix" in head
    assert head.index("block.mix") < head.index("first module that differs: block.norm")
    assert "its parameters differ between the runs: block.mix.weight" in head


def test_the_old_one_command_form(runs, run_cli):
    res = run_cli("bisect", "--between", f"run:{runs['a']},run:{runs['b']}", "--json", "--no-save")
    assert res.code == 0, res.err
    assert res.json()["maker"] == "block.mix"


def test_the_same_run_twice(runs, run_cli):
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['a2']}")
    assert res.code == USAGE and "record the same bits at every step" in res.err  # no step to pick
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['a2']}", "--step", 2, "--json")
    assert res.code == 0, res.err
    data = res.json()
    assert data["first"] is None and data["parameters_differ"] == []
    assert all(m["verdict"] == "bitwise equal" for m in data["modules"]) and len(data["modules"]) == 5


def test_a_side_that_raised_is_not_called_equal(runs, run_cli):
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['a2']}", "--step", 2, "--set", "raise=1")
    assert res.code == RERUN_ERROR
    head = res.out.splitlines()[0]
    assert "raised RuntimeError" in head and "bitwise equal" not in head
    assert "nothing after it was compared" in head


@pytest.mark.parametrize("between, words", [
    ("run:{a},rank:1", "cannot be mixed"),
    ("run:{a},run:{b},run:{a}", "cannot be mixed"),
    ("run:,run:{b}", "two runs are run:PATH_A,run:PATH_B"),
    ("run:{a}:run-000/7,run:{b}", "has no rank 7"),
])
def test_bad_run_specs_are_one_line(runs, run_cli, between, words):
    res = _bisect(run_cli, "--between", between.format(a=runs["a"], b=runs["b"]))
    assert res.code != 0 and words in res.err
    assert "Traceback" not in res.err and len([ln for ln in res.err.splitlines() if ln.strip()]) == 1


def test_through_the_api(runs):
    with Recording(runs["a"]) as ra, Recording(runs["b"]) as rb:
        result = api.bisect_runs(ra["run-000"], rb["run-000"])
    assert result.step == 0 and result.maker is not None and result.maker.module == "block.mix"
    assert result.problem() is None and result.maker_params() == ["block.mix.weight"]


def test_a_factory_that_rebuilds_one_model_for_both_runs_is_called_out(runs, run_cli):
    """The factory ignores the recorded config and builds run A's weights for run B too: the
    re-runs then agree module by module, which says nothing of what B ran. The first line says
    B's rebuilt weights are not the weights it ran with (it used to say only "bitwise equal")."""
    res = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}", "--factory", "tests.runs_engine:build_base",
                  "--json")
    assert res.code == 0, res.err
    data = res.json()
    b = data["sides"][1]
    assert b["weights"]["same"] is False and b["weights"]["differ"] == ["block.mix.weight"]
    assert data["sides"][0]["weights"]["same"] is True
    head = _bisect(run_cli, "--between", f"run:{runs['a']},run:{runs['b']}", "--factory",
                   "tests.runs_engine:build_base").out.splitlines()[0]
    assert "run B's rebuilt weights are not the weights it ran with (1 differ: block.mix.weight)" in head, head
    assert "run A's rebuilt" not in head
