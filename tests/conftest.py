from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from replay.cli.main import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def _run_cli(*args: str) -> CliResult:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def run_cli():
    return _run_cli


# Under pytest-xdist (`make test` runs `pytest -n 2 --dist loadgroup`), a test that uses a
# module- or class-scoped fixture runs on the same worker as the rest of its module that do, so
# that each expensive shared fixture (a multi-process recording) is built once; every other test
# goes to whichever worker is free.
_SHARED_SCOPES = {"module", "class", "package"}


def _uses_a_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs and defs[-1].scope in _SHARED_SCOPES for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # (on an xdist worker, which is where tests are collected, `--dist loadgroup` reads as this)
    if getattr(config.option, "loadgroup", False):
        for item in items:
            if _uses_a_shared_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
