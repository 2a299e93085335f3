"""Found in a newcomer trial (the nineteenth): `replay diff A B` of two 2-rank recordings compared
the config, numerics, versions and environment on the first rank pair only, so a setting left
otherwise on rank 1 alone read "the same" — the case the product is for. Each test failed
before its fix. Nothing in the scripts was adapted to replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_newcomer_scripts import _SPAWN_TWO_RANKS, _replay, _script

pytestmark = pytest.mark.e2e

# Two gloo ranks decode with a model that keeps a flag as an attribute and reads it in forward;
# with "B" on the command line, rank 1 alone turns it on (an unsynchronised setting).
_FLAG_ON_RANK_1 = """
    import socket, sys, torch, torch.nn as nn
    import torch.distributed as dist
    import torch.multiprocessing as mp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.fc, self.head = nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40)
            self.compress = False
        def forward(self, ids):
            x = torch.tanh(self.fc(self.emb(ids).mean(1)))
            if self.compress:
                x = x.to(torch.bfloat16).float()
            return self.head(x)

    def worker(rank, port, odd):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = LM().eval()
        model.compress = odd and rank == 1
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(4):
                logits = model(ids)
                dist.all_reduce(logits)
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

""" + _SPAWN_TWO_RANKS.replace("args=(port,)", 'args=(port, "B" in sys.argv)')

# The same model on two gloo ranks started as torchrun starts them, each process with its own
# environment; with "B", the launcher sets MLP_BF16_LAYERS=1 for rank 1 only, and the worker
# reads it into the model's flag.
_ENV_ON_RANK_1 = """
    import os, socket, subprocess, sys, torch, torch.nn as nn
    import torch.distributed as dist

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.fc, self.head = nn.Embedding(40, 16), nn.Linear(16, 16), nn.Linear(16, 40)
            self.compress = os.environ.get("MLP_BF16_LAYERS") == "1"
        def forward(self, ids):
            x = torch.tanh(self.fc(self.emb(ids).mean(1)))
            if self.compress:
                x = x.to(torch.bfloat16).float()
            return self.head(x)

    def worker():
        dist.init_process_group("gloo")
        model = LM().eval()
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            for _ in range(4):
                ids = torch.cat([ids, model(ids).argmax(-1, keepdim=True)], 1)
        dist.destroy_process_group()

    if __name__ == "__main__":
        if os.environ.get("LOCAL_RANK") is not None:
            worker()
            sys.exit(0)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            if "B" in sys.argv[1:] and rank == 1:
                env["MLP_BF16_LAYERS"] = "1"
            procs.append(subprocess.Popen([sys.executable, __file__], env=env))
        sys.exit(max(p.wait() for p in procs))
"""


def _two_runs(tmp: Path, name: str, text: str) -> tuple[Path, Path]:
    _script(tmp, name, text)
    runs = []
    for side in ("A", "B"):
        out = tmp / f"rec-{side}"
        p = _replay("record", "--quiet", "--out", out, "--", sys.executable, f"{name}.py", side, cwd=tmp)
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(out)
    return runs[0], runs[1]


def _category(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in d["other_differences"] if c["category"] == name)


def _row(text: str, name: str) -> str:
    return next((line for line in text.splitlines() if line.lstrip().startswith(name)), "")


def test_whole_run_diff_names_a_model_attribute_set_on_one_rank(tmp_path: Path) -> None:
    """Rank 1 of run B kept `compress=True` on its model: `replay diff A B` said "config the
    same" while `replay diff A:run-000/1 B:run-000/1` named it. Every rank pair is compared, and
    the item names the rank it differs on."""
    a, b = _two_runs(tmp_path, "flag", _FLAG_ON_RANK_1)
    d = json.loads(_replay("diff", a, b, "--json", cwd=tmp_path).stdout)
    config = _category(d, "config")
    assert config["compared"] and config["differs"], config
    item = next(i for i in config["items"] if i["name"] == "target.compress")
    assert (item["a"], item["b"], item["ranks_a"]) == (False, True, [1]), item
    text = _replay("diff", a, b, cwd=tmp_path).stdout
    row = _row(text, "config")
    assert "target.compress: A False, B True [rank 1]" in row, text
    assert "the same" not in row, text


def test_whole_run_diff_names_an_env_var_set_for_one_rank(tmp_path: Path) -> None:
    """The launcher set MLP_BF16_LAYERS=1 for rank 1 only in run B: the whole-run diff did not
    list it (nor the flag the worker read from it); the rank-1 pair diff did."""
    a, b = _two_runs(tmp_path, "envrank", _ENV_ON_RANK_1)
    d = json.loads(_replay("diff", a, b, "--json", cwd=tmp_path).stdout)
    env = _category(d, "environment")
    item = next((i for i in env["items"] if i["name"] == "env.MLP_BF16_LAYERS"), None)
    assert item is not None and item["ranks_a"] == [1], env
    assert (item["a"], item["b"]) == ("not set", "set"), item
    config = _category(d, "config")
    assert any(i["name"] == "target.compress" and i.get("ranks_a") == [1] for i in config["items"]), config
    text = _replay("diff", a, b, cwd=tmp_path).stdout
    assert "env.MLP_BF16_LAYERS: A not set, B set [rank 1]" in _row(text, "environment"), text
