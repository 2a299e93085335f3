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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
