"""A plain two-rank program that knows nothing of replay: run as `python tests/plain_engine_script.py`.

Its engine class lives in the script itself (so it runs as __main__, and as __mp_main__ in the
spawned ranks). With PERTURB=1, rank 1 drifts from step 4.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class MyEngine:
    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.w = torch.randn(16, 16, generator=g) / 4
        self.kv = torch.zeros(4, 16)
        self.rank = rank

    def state(self) -> dict:
        return {"kv": self.kv}

    def step(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        h = torch.tanh(x @ self.w + self.kv[pos % 4])
        if os.environ.get("PERTURB") == "1" and self.rank == 1 and pos >= 4:
            h = h + 1e-3
        summed = h.clone()
        dist.all_reduce(summed)
        self.kv[pos % 4] = summed[0] / 2
        return h


def run(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # TWO_ENGINES=1: a second engine after the first, in the same process group (a second run).
    for _ in range(2 if os.environ.get("TWO_ENGINES") == "1" else 1):
        eng = MyEngine(rank)
        x = torch.ones(2, 16)
        for pos in range(steps):
            x = eng.step(x, pos)
        del eng
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(run, args=(2, port, int(sys.argv[1]) if len(sys.argv) > 1 else 8), nprocs=2)
    sys.exit(int(os.environ.get("EXIT_CODE", "0")))
