"""What the drain process costs the host per recorded step (a development tool).

The drain runs beside the program; on a host whose cores the program's threads fill (a CPU
decode step with intra-op threads) its CPU time is taken from the program. This records
``--steps`` decode steps of the ``mtp`` engine (every step recorded) and reports the drain
process's CPU time (user + system, from ``/proc``) per step, with its own counters
(``REPLAY_DRAIN_STATS``): jobs, time building frames and writing, and how often it slept.

    python3 benchmarks/diag/drain_cpu.py                         # CPU, tiny preset
    python3 benchmarks/diag/drain_cpu.py --device cuda --preset small --graphs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    preset = args.preset or ("small" if cuda else "tiny")
    stats_file = Path(tempfile.mkdtemp()) / "drain-stats.jsonl"
    os.environ["REPLAY_DRAIN_STATS"] = str(stats_file)
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    batch = 8 if cuda else 4
    cfg = {"preset": preset, "cudagraph": args.graphs, "device": args.device, "batch": batch, "buckets": [batch]}
    print(f"{preset} device={args.device} graphs={'on' if args.graphs else 'off'} steps={args.steps} (each round a new recording)")
    for r in range(args.rounds):
        engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
        engine.prefill()
        if args.graphs:
            engine.capture_graphs()
        with tempfile.TemporaryDirectory() as tmp:
            session = Session(Path(tmp), RecordSettings(drain="process"))
            session.install()
            try:
                times = []
                proc = None
                for i in range(args.steps + 20):
                    if i == 20:  # the drain started with the first recorded step: counted from here
                        proc = session.recorder._writer._proc
                        c0, w0 = _cpu_s(proc.pid), time.perf_counter()
                    inputs = engine.step_inputs()
                    t0 = time.perf_counter()
                    out = Engine.decode_step(engine, *inputs)
                    out.accepted.tolist()
                    times.append(time.perf_counter() - t0)
                    engine.advance(out)
                assert proc is not None
                c1, w1 = _cpu_s(proc.pid), time.perf_counter()
            finally:
                session.shutdown()
                session.disabled = True
                Engine.decode_step = getattr(Engine.decode_step, "__wrapped__", Engine.decode_step)
        st = json.loads(stats_file.read_text().splitlines()[-1])
        jobs = max(st["jobs"], 1)
        print(f"  round {r}: drain CPU {1e6 * (c1 - c0) / args.steps:7.0f} µs/step ({100 * (c1 - c0) / (w1 - w0):4.1f}% of a core); "
              f"step median {1e6 * statistics.median(times[20:]):7.0f} µs; "
              f"drain per job: frame {1e6 * st['frame_s'] / jobs:5.0f} µs, write {1e6 * st['write_s'] / jobs:5.0f} µs, "
              f"{st['sleeps'] / jobs:5.1f} sleeps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
