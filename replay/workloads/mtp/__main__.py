"""``python -m replay.workloads.mtp``: run the reference engine on N ranks and print throughput.

Exit codes: 0 success, 3 rank drift (one line on stderr), 1 another rank failure, 2 bad usage.
Under torchrun (RANK and WORLD_SIZE set) it runs the one rank torchrun started.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import click
import torch.distributed as dist

from replay.workloads.mtp.config import (
    DTYPES,
    LAYOUTS,
    TUNER_MODES,
    EngineConfig,
    ModelArgs,
)
from replay.workloads.mtp.launch import RankResult, init_from_env, run, run_rank

EXIT_DRIFT = 3


def _summary(results: list[RankResult], tokens: bool) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        row = dataclasses.asdict(r)
        if not tokens:
            for key in ("tokens", "accepted", "prefill_tokens", "logits_digests"):
                row.pop(key)
        rows.append(row)
    return rows


def _render(config: EngineConfig, results: list[RankResult]) -> None:
    click.echo(
        f"preset {config.preset} · layout {config.layout} · {config.ranks} rank(s) · device {config.device} · "
        f"cudagraph {'on' if config.cudagraph else 'off'} · tuner {config.tuner} · k {config.k} · batch {config.batch}"
    )
    click.echo(
        f"{'rank':>4}  {'steps':>5}  {'steps/s':>8}  {'tokens/s':>8}  {'accept':>6}  {'graph':>5}  {'eager':>5}  tuner"
    )
    for r in results:
        tok_s = r.steps_per_s * (1 + config.k * r.acceptance_rate) * config.batch
        tuner = ", ".join(f"{k}={v}" for k, v in sorted(r.tuner_choices.items())) or "-"
        click.echo(
            f"{r.rank:>4}  {r.steps:>5}  {r.steps_per_s:>8.1f}  {tok_s:>8.1f}  {r.acceptance_rate:>6.3f}  "
            f"{r.graph_steps:>5}  {r.eager_steps:>5}  {tuner}"
        )
    ok = [r for r in results if r.steps]
    if ok:
        rate = sum(r.steps_per_s for r in ok) / len(ok)
        acc = sum(r.acceptance_rate for r in ok) / len(ok)
        click.echo(f"decode throughput {rate:.1f} steps/s per rank, acceptance rate {acc:.3f}")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--preset", type=click.Choice(sorted(ModelArgs.presets)), default="tiny")
@click.option("--seed", type=int, default=0)
@click.option("--layout", type=click.Choice(LAYOUTS), default="replicated")
@click.option(
    "--ranks", type=click.IntRange(min=1), default=1, help="Ranks to spawn (ignored under torchrun)."
)
@click.option("--steps", type=click.IntRange(min=1), default=200, help="Decode steps.")
@click.option("--k", "k", type=click.IntRange(min=1), default=3, help="Draft length.")
@click.option("--batch", type=click.IntRange(min=1), default=4, help="Concurrent requests.")
@click.option(
    "--cudagraph/--no-cudagraph", default=False, help="Bucketed static-buffer runner (CUDA graphs on GPU)."
)
@click.option("--buckets", default="1,2,4,8", help="Comma-separated batch buckets.")
@click.option("--prompt-len-min", type=click.IntRange(min=1), default=8)
@click.option("--prompt-len-max", type=click.IntRange(min=1), default=24)
@click.option(
    "--warmup-iters", type=click.IntRange(min=1), default=3, help="Warm-up runs before each capture."
)
@click.option("--max-seq-len", type=click.IntRange(min=0), default=0, help="0: the preset's.")
@click.option("--cpu-threads", type=click.IntRange(min=1), default=1, help="Intra-op threads on CPU.")
@click.option("--device", default="cpu", help="cpu, or cuda (one GPU per rank).")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32")
@click.option("--tuner", type=click.Choice(TUNER_MODES), default="off", help="Autotuner mode during warm-up.")
@click.option("--tuner-low-precision", is_flag=True, help="Let the tuner time the bf16 combine too.")
@click.option(
    "--force-tactic", multiple=True, metavar="RANK:OP:TACTIC", help="e.g. 1:moe_combine:bf16 (repeatable)."
)
@click.option("--nondeterministic-combine", is_flag=True, help="MoE combine through index_add_ (atomics).")
@click.option("--deterministic", is_flag=True, help="torch.use_deterministic_algorithms(True).")
@click.option("--tf32", is_flag=True, help="Allow TF32 matmuls (CUDA).")
@click.option("--bug-baked-kv-len", is_flag=True, help="Graph hazard: KV length baked in at capture.")
@click.option(
    "--bug-stale-padding", is_flag=True, help="Graph hazard: padded rows keep stale slot ids and pages."
)
@click.option("--one-shot-allreduce", is_flag=True, help="TP all-reduce summed in rank-rotated order.")
@click.option("--broadcast-tokens", is_flag=True, help="Take rank 0's tokens every step (hides drift).")
@click.option("--no-lockstep", is_flag=True, help="Do not check accepted counts across ranks.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-rank results as JSON.")
@click.option(
    "--tokens", "with_tokens", is_flag=True, help="With --json: include tokens and accepted counts."
)
@click.option("--timeout", "timeout_s", type=float, default=600.0, help="Seconds to wait for all ranks.")
def main(
    *,
    steps: int,
    buckets: str,
    force_tactic: tuple[str, ...],
    no_lockstep: bool,
    as_json: bool,
    with_tokens: bool,
    timeout_s: float,
    **fields: Any,
) -> None:
    """Run the MTP reference engine and print decode throughput and acceptance rate."""
    ctx = click.get_current_context()
    try:
        bucket_sizes = tuple(int(b) for b in buckets.split(",") if b.strip())
        config = EngineConfig(
            **fields,
            buckets=bucket_sizes,
            force_tactic=force_tactic,
            lockstep=not no_lockstep,
            timeout_s=timeout_s,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = init_from_env(config)
        config = config.replace(ranks=world)
        try:
            results = [run_rank(config, rank=rank, world_size=world, steps=steps)]
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    else:
        results = run(config, steps=steps, timeout_s=timeout_s)
    if results[0].rank == 0:  # under torchrun only rank 0 prints
        if as_json:
            summary = {"config": config.to_dict(), "ranks": _summary(results, with_tokens)}
            click.echo(json.dumps(summary, indent=2))
        else:
            _render(config, results)
    drift = next((r for r in results if r.error_type == "RankDriftError"), None)
    if drift is not None:
        click.echo(f"error: {drift.error}", err=True)
        ctx.exit(EXIT_DRIFT)
    failed = next((r for r in results if r.error is not None), None)
    if failed is not None:
        click.echo(f"error: rank {failed.rank}: {failed.error}", err=True)
        ctx.exit(1)


if __name__ == "__main__":
    main()
