"""Plain-tensor tensor parallelism (no DTensor), the subject of `bisect --between rank:0,rank:1`.

Each rank draws the full weights from one seed and keeps its shard: a column-parallel ``up``
(rows of the weight), a row-parallel ``down`` (columns) whose output a forward hook all-reduces,
and replicated ``norm`` and ``head``. With ``perturb_rank``, that rank's replicated ``norm``
weight is off by 1e-3: a replicated weight that differs, not a shard.
``python -m tests.tp_engine STEPS JSON_CONFIG`` runs two ranks on gloo.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D, H, V = 16, 32, 24


class TPModel(torch.nn.Module):
    def __init__(self, config: dict, rank: int, world: int) -> None:
        super().__init__()
        self.config = dict(config)
        g = torch.Generator().manual_seed(int(config.get("seed", 0)))
        up, down, head = torch.randn(H, D, generator=g) / 4, torch.randn(D, H, generator=g) / 4, torch.randn(V, D, generator=g)
        self.norm = torch.nn.LayerNorm(D, elementwise_affine=True)
        self.up = torch.nn.Linear(D, H // world, bias=False)
        self.down = torch.nn.Linear(H // world, D, bias=False)
        self.head = torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(up.chunk(world, 0)[rank])
            self.down.weight.copy_(down.chunk(world, 1)[rank])
            self.head.weight.copy_(head)
            if config.get("perturb_rank") == rank:
                self.norm.weight.add_(1e-3)
        if world > 1:
            self.down.register_forward_hook(lambda _m, _i, out: dist.all_reduce(out) or out)
        self.register_buffer("h", torch.zeros(2, D))

    def replay_config(self) -> dict:
        return self.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.h + self.down(torch.relu(self.up(self.norm(x + self.h))))
            self.h.copy_(h)
            return self.head(h)


def build(config: dict, *, rank: int, world_size: int, device: str, options: dict) -> TPModel:
    return TPModel(config, rank, world_size)


def _run(rank: int, world: int, port: int, steps: int, config: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = TPModel(config, rank, world)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        x = torch.tanh(model(x)[:, :D])
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(_run, args=(2, port, int(sys.argv[1]), json.loads(sys.argv[2])), nprocs=2)
