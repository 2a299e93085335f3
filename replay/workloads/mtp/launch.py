"""Run the engine on N ranks: spawned processes (never fork) or one torchrun rank.

Ranks are separate Python processes started with the ``spawn`` method, so anything injected into
every Python process (a ``sitecustomize`` on ``PYTHONPATH``, as ``replay record`` does) runs in
each rank too. `run_many` runs several configurations in one set of processes, which saves the
process start-up (most of the time of a short CPU run).
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replay.workloads.mtp.config import EngineConfig
from replay.workloads.mtp.engine import Engine, GenerateResult
from replay.workloads.mtp.errors import RankDriftError

__all__ = ["RankResult", "free_port", "init_from_env", "rank_device", "run", "run_many", "run_rank"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RankResult:
    rank: int
    steps: int = 0
    """Decode steps completed (before an error, if one was raised)."""
    tokens: list[list[list[int]]] = field(default_factory=list)
    """Per step, per request: the tokens accepted."""
    accepted: list[list[int]] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    logits_digests: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    steps_per_s: float = 0.0
    acceptance_rate: float = 0.0
    """Fraction of drafted tokens accepted."""
    tuner_choices: dict[str, str] = field(default_factory=dict)
    graph_steps: int = 0
    eager_steps: int = 0
    overridden_steps: int = 0
    error: str | None = None
    error_type: str | None = None
    drift_step: int | None = None
    drift_ranks: list[int] | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(config: EngineConfig, rank: int) -> str:
    """``cuda`` means one GPU per rank (the local rank modulo the visible GPUs); anything else is
    used as is."""
    if config.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        return f"cuda:{local % max(torch.cuda.device_count(), 1)}"
    return config.device


def _summarise(result: RankResult, gen: GenerateResult, engine: Engine) -> None:
    result.steps = gen.steps
    result.tokens = gen.tokens
    result.accepted = gen.accepted
    result.prefill_tokens = gen.prefill_tokens
    result.logits_digests = gen.logits_digests
    result.elapsed_s = gen.elapsed_s
    result.steps_per_s = gen.steps_per_s
    drafted = gen.steps * engine.config.batch * engine.k
    result.acceptance_rate = (
        (sum(map(sum, gen.accepted)) - gen.steps * engine.config.batch) / drafted if drafted else 0.0
    )
    result.tuner_choices = engine.tuner_choices()
    result.graph_steps = gen.graph_steps
    result.eager_steps = gen.eager_steps
    result.overridden_steps = engine.overridden_steps


def run_rank(
    config: EngineConfig, *, rank: int, world_size: int, steps: int, digests: bool = False
) -> RankResult:
    """Build and run this rank inside an initialised process group; errors land in the result."""
    result = RankResult(rank=rank)
    engine: Engine | None = None
    gen = GenerateResult(steps=0, prefill_tokens=[])
    try:
        engine = Engine(config, rank=rank, world_size=world_size, device=rank_device(config, rank))
        engine.generate(steps, digests=digests, history=gen)
    except RankDriftError as e:
        result.error, result.error_type = str(e), "RankDriftError"
        result.drift_step, result.drift_ranks = e.step, e.ranks
    except Exception as e:  # noqa: BLE001 - a rank's failure is reported, not raised, so the others are collected
        result.error = f"{type(e).__name__}: {e}"
        result.error_type = type(e).__name__
        log.debug("rank %d failed:\n%s", rank, traceback.format_exc())
    if engine is not None:
        _summarise(result, gen, engine)
    return result


def _worker(
    rank: int, world_size: int, port: int, configs: list[dict[str, Any]], steps: int, digests: bool, out: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    cfgs = [EngineConfig.from_dict(c) for c in configs]
    if world_size > 1:
        if cfgs[0].device.startswith("cuda"):
            torch.cuda.set_device(rank_device(cfgs[0], rank))
        backend = "nccl" if cfgs[0].device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(c.timeout_s for c in cfgs)),
        )
    try:
        for index, cfg in enumerate(cfgs):
            result = run_rank(cfg, rank=rank, world_size=world_size, steps=steps, digests=digests)
            out.put((index, rank, result))
            if result.error is not None and result.error_type != "RankDriftError":
                break  # the group may be out of step now; later configs would only time out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_many(
    configs: list[EngineConfig],
    *,
    ranks: int,
    steps: int,
    digests: bool = False,
    timeout_s: float = 600.0,
) -> list[list[RankResult]]:
    """Run each config on the same ``ranks`` spawned processes, one after the other.

    Returns, per config, one `RankResult` per rank (sorted by rank). A rank that died or did not
    report within ``timeout_s`` gets a result whose ``error`` says so.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    devices = {c.device.split(":")[0] for c in configs}
    if len(devices) > 1:
        raise ValueError(f"run_many needs one device type for all configs, got {sorted(devices)}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    payload = [c.to_dict() for c in configs]
    procs = [
        ctx.Process(target=_worker, args=(r, ranks, port, payload, steps, digests, out), name=f"mtp-rank{r}")
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        results = _collect(out, procs, expected=len(configs) * ranks, deadline=deadline)
    finally:
        _reap(procs, deadline)
        out.close()
    return [
        [results[(index, rank)] if (index, rank) in results else _lost(rank, index, p) for rank, p in enumerate(procs)]
        for index in range(len(configs))
    ]


def _collect(out: Any, procs: list[Any], *, expected: int, deadline: float) -> dict[tuple[int, int], RankResult]:
    """The (config index, rank) -> result reports from ``out`` until ``expected`` came, the
    deadline passed, or every process is gone (then what they put before exiting is drained)."""
    results: dict[tuple[int, int], RankResult] = {}
    while len(results) < expected and time.monotonic() < deadline:
        try:
            index, rank, result = out.get(timeout=0.2)
            results[(index, rank)] = result
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs):
                _drain(out, results)
                break
    return results


def _drain(out: Any, results: dict[tuple[int, int], RankResult]) -> None:
    while True:
        try:
            index, rank, result = out.get(timeout=0.5)
        except queue_mod.Empty:
            return
        results[(index, rank)] = result


def _reap(procs: list[Any], deadline: float) -> None:
    """Wait for the processes until the deadline (10 s at most), then end those still running."""
    for p in procs:
        p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def _lost(rank: int, index: int, proc: Any) -> RankResult:
    """The result of a rank that never reported config ``index``: why, as far as is known."""
    status = "timed out" if proc.exitcode is None or proc.exitcode < 0 else f"exited with code {proc.exitcode}"
    return RankResult(rank=rank, error_type="Lost", error=f"rank {rank} {status} before reporting config {index}")


def run(
    config: EngineConfig,
    *,
    ranks: int | None = None,
    steps: int,
    digests: bool = False,
    timeout_s: float = 600.0,
) -> list[RankResult]:
    """Run ``config`` on ``ranks`` (default ``config.ranks``) spawned processes for ``steps`` decode steps."""
    n = config.ranks if ranks is None else ranks
    return run_many([config.replace(ranks=n)], ranks=n, steps=steps, digests=digests, timeout_s=timeout_s)[0]


def init_from_env(config: EngineConfig) -> tuple[int, int]:
    """Under torchrun: read RANK / WORLD_SIZE (and MASTER_ADDR / MASTER_PORT) and join the group."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank_device(config, rank))
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=config.timeout_s)
        )
    return rank, world_size
