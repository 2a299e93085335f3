"""Benchmark the MTP reference engine: decode steps/s eager vs graph runner, and drift frequency.

    python benchmarks/bench_mtp.py                                   # tiny on CPU
    python benchmarks/bench_mtp.py --device cuda --preset small      # H200: real CUDA graphs
    python benchmarks/bench_mtp.py --device cuda --preset small --drift-trials 10 --drift-steps 2000

Part 1 runs one rank (no process group) and times `--steps` decode steps after prefill and capture,
eager and through the graph runner, `--repeats` times each, interleaved (the best is reported, as
timing noise only ever slows a run down; the median too). Part 2 (on CUDA by default) runs `--drift-trials` fresh multi-rank
runs with the tuner timing its tactics independently on every rank during capture, and counts the
runs that end in a RankDriftError; a control with the broadcast tuner runs alongside.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from replay.workloads.mtp.config import EngineConfig
from replay.workloads.mtp.engine import Engine
from replay.workloads.mtp.launch import RankResult, run_many


def time_decode(configs: dict[str, EngineConfig], steps: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Time each config ``repeats`` times, interleaved, so a change of machine load hits all alike."""
    rates: dict[str, list[float]] = {name: [] for name in configs}
    acceptance: dict[str, float] = {}
    for _ in range(repeats):
        for name, config in configs.items():
            engine = Engine(config, device=config.device)
            result = engine.generate(steps)
            rates[name].append(result.steps_per_s)
            drafted = result.steps * config.batch * config.k
            acceptance[name] = (sum(map(sum, result.accepted)) - result.steps * config.batch) / drafted
    return {
        name: {
            "steps_per_s": max(rates[name]),
            "median_steps_per_s": statistics.median(rates[name]),
            "acceptance": acceptance[name],
        }
        for name in configs
    }


def drift_trials(config: EngineConfig, *, ranks: int, trials: int, steps: int) -> dict[str, Any]:
    configs = [config.replace(seed=config.seed + i, ranks=ranks) for i in range(trials)]
    table: list[list[RankResult]] = run_many(configs, ranks=ranks, steps=steps, timeout_s=3600)
    drifted = [rows[0].drift_step for rows in table if rows[0].error_type == "RankDriftError"]
    failed = [rows[0].error for rows in table if rows[0].error and rows[0].error_type != "RankDriftError"]
    split = sum(1 for rows in table if len({json.dumps(r.tuner_choices, sort_keys=True) for r in rows}) > 1)
    return {
        "tuner": config.tuner,
        "trials": trials,
        "steps": steps,
        "drifted": len(drifted),
        "drift_steps": drifted,
        "tuner_choices_differ": split,
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ranks of each drift trial")
    p.add_argument("--drift-trials", type=int, default=None, help="default: 10 on cuda, 0 on cpu")
    p.add_argument("--drift-steps", type=int, default=2000)
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = p.parse_args(argv)

    base = EngineConfig(preset=args.preset, device=args.device, dtype=args.dtype, batch=args.batch, k=args.k)
    timed = time_decode({"eager": base, "graph": base.replace(cudagraph=True)}, args.steps, args.repeats)
    eager, graph = timed["eager"], timed["graph"]
    report: dict[str, Any] = {
        "machine": {
            "device": torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cpu_threads": base.cpu_threads,
        },
        "config": {
            "preset": args.preset,
            "dtype": args.dtype,
            "batch": args.batch,
            "k": args.k,
            "steps": args.steps,
        },
        "eager": eager,
        "graph": graph,
        "graph_over_eager": graph["steps_per_s"] / eager["steps_per_s"],
        "drift": [],
    }
    trials = (
        args.drift_trials if args.drift_trials is not None else (10 if args.device.startswith("cuda") else 0)
    )
    if trials and args.device.startswith("cuda") and torch.cuda.device_count() < args.ranks:
        report["drift_skipped"] = (
            f"{args.ranks} ranks need {args.ranks} GPUs; {torch.cuda.device_count()} visible"
        )
        trials = 0
    if trials:
        # Long runs: every sequence must fit, so no request restarts mid-run.
        model = base.model_args()
        needed = base.prompt_len_max + (args.drift_steps + 1) * (args.k + 1)
        length = max(math.ceil(needed / model.page_size) * model.page_size, model.max_seq_len)
        drift_cfg = base.replace(cudagraph=True, max_seq_len=length)
        for tuner in ("independent", "broadcast"):
            report["drift"].append(
                drift_trials(
                    drift_cfg.replace(tuner=tuner), ranks=args.ranks, trials=trials, steps=args.drift_steps
                )
            )

    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"MTP engine · preset {args.preset} · {args.device} ({report['machine']['device']}) · dtype {args.dtype} · "
        f"batch {args.batch} · k {args.k} · torch {torch.__version__}\n"
    )
    print("| runner | decode steps/s (best) | median | acceptance |")
    print("| --- | --- | --- | --- |")
    for name, r in (("eager", eager), ("graph runner", graph)):
        print(f"| {name} | {r['steps_per_s']:.1f} | {r['median_steps_per_s']:.1f} | {r['acceptance']:.3f} |")
    print(f"\ngraph runner / eager: {report['graph_over_eager']:.2f}x")
    if "drift_skipped" in report:
        print(f"\ndrift trials skipped: {report['drift_skipped']}")
    if report["drift"]:
        print(
            "\n| tuner | ranks | trials | steps | runs that drifted | runs whose tuner choices differ | drift steps |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for d in report["drift"]:
            print(
                f"| {d['tuner']} | {args.ranks} | {d['trials']} | {d['steps']} | {d['drifted']} | "
                f"{d['tuner_choices_differ']} | {d['drift_steps'] or '-'} |"
            )
            for error in d["failed"]:
                print(f"\nfailed trial: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
