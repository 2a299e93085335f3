"""Decode greedily with the example engine on N ranks: ``python -m examples.hf_llama.run``.

    python -m examples.hf_llama.run --ranks 2 --tp --steps 8
    python -m examples.hf_llama.run --ranks 2 --steps 8 --perturb-rank 1 --perturb-at 3
    python -m examples.hf_llama.run --device cuda --preset small --dtype bfloat16 --graphs manual

Each rank is a process (``torch.multiprocessing.spawn``) in one process group: gloo on the
CPU, NCCL on GPUs (rank r on cuda:r). This script is the user's program: it knows nothing of
``replay``; record it with ``replay record ... -- python -m examples.hf_llama.run ...``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from dataclasses import asdict
from typing import Any

import torch

from examples.hf_llama.engine import GRAPH_MODES, DecoderConfig

__all__ = ["main", "run_rank"]


def run_rank(rank: int, world: int, port: int, config: dict[str, Any], steps: int, device: str) -> None:
    import torch.distributed as dist

    dev = f"cuda:{rank}" if device == "cuda" else device
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo", rank=rank, world_size=world)
    try:
        tokens = _generate(config, rank, world, dev, steps)
        if rank == 0:
            print(json.dumps({"tokens": tokens}), flush=True)
    finally:
        if world > 1:
            # A CUDA graph that captured NCCL collectives must be gone before its communicator,
            # or destroy_process_group waits forever (pytorch/pytorch#115388): the engine and its
            # graph were dropped when _generate returned; collect any cycle still holding them.
            gc.collect()
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            dist.destroy_process_group()


def _generate(config: dict[str, Any], rank: int, world: int, dev: str, steps: int) -> list[list[int]]:
    from examples.hf_llama.engine import build

    engine = build(config, rank=rank, world_size=world, device=dev, options={})
    return engine.generate(steps).tolist()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.hf_llama.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1, help="number of ranks (processes)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps after the prompt")
    ap.add_argument("--tp", action="store_true", help="tensor-parallel over the ranks (else each rank holds the whole model)")
    ap.add_argument("--graphs", choices=GRAPH_MODES, default="none", help="CUDA graphs: none, manual (captured by hand), compile")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--perturb-rank", type=int, default=None, help="plant a bug: perturb a weight on this rank")
    ap.add_argument("--perturb-at", type=int, default=0, help="... from this decode step on")
    ap.add_argument("--perturb-module", default="model.norm", help="... of this module (its .weight)")
    a = ap.parse_args(argv)
    try:
        cfg = DecoderConfig(preset=a.preset, seed=a.seed, dtype=a.dtype, batch=a.batch, prompt_len=a.prompt_len, tp=a.tp,
                            graphs=a.graphs, perturb_rank=a.perturb_rank, perturb_at=a.perturb_at,
                            perturb_module=a.perturb_module)
    except ValueError as e:
        print(f"run: {e}", file=sys.stderr)
        return 2
    if a.graphs != "none" and a.device != "cuda":
        print(f"run: --graphs {a.graphs} needs --device cuda", file=sys.stderr)
        return 2
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        print(f"run: --ranks {a.ranks} on cuda needs {a.ranks} GPUs ({torch.cuda.device_count()} here)", file=sys.stderr)
        return 2
    config = asdict(cfg)
    if a.ranks == 1:
        run_rank(0, 1, 0, config, a.steps, a.device)
    else:
        torch.multiprocessing.spawn(run_rank, args=(a.ranks, _free_port(), config, a.steps, a.device), nprocs=a.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
