"""What the drain process's scheduling costs a CPU decode step (a development tool).

On a host whose cores the program's intra-op threads fill (a CPU decode step), the drain's CPU
time is taken from the program: each time it wakes it may preempt one of the program's threads
inside a parallel region, which the other threads then wait for. This runs
``bench_record.py --only cpu`` (the default recorder against the plain step, CPU ``tiny``) in
turn with the drain process scheduled as the program (``normal``), as ``SCHED_BATCH``, as
``SCHED_IDLE`` and at nice 19 (``REPLAY_DRAIN_SCHED``), ``--rounds`` times in alternation, and
prints each policy's overhead per round and its median; and the ring's waits for room (a drain
that falls behind makes the program wait at a step boundary).

    python3 benchmarks/diag/drain_priority.py --rounds 3 --cpu-blocks 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def one_run(policy: str, blocks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        env = {**os.environ, "REPLAY_DRAIN_SCHED": policy}
        subprocess.run([sys.executable, str(HERE / "bench_record.py"), "--device", "cpu", "--only", "cpu",
                        "--cpu-blocks", str(blocks), "--out", str(out)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        rows = json.loads(out.read_text())["overhead"]
    return next(r for r in rows if r.get("default"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-blocks", type=int, default=16)
    ap.add_argument("--policies", default="normal,batch,idle,nice")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for p in order:
            runs[p].append(one_run(p, args.cpu_blocks))
            row = runs[p][-1]
            ring = row.get("ring") or {}
            print(f"round {r} {p:7s} plain {row['plain_ms']:.3f} ms  recorded {row['recorded_ms']:.3f} ms  "
                  f"{row['overhead_pct']:+.1f}% ({row['overhead_us']:+.0f} µs)  drain CPU {ring.get('drain_cpu_us_per_step')} µs/step  "
                  f"ring waits {ring.get('full_waits')}", flush=True)
    print(f"\n{os.cpu_count()} cores; `python3 {' '.join(sys.argv)}`")
    print("| drain scheduling | overhead, median of rounds | each round | per step, median | ring waits for room |")
    print("|---|---:|---|---:|---:|")
    for p in policies:
        pct = [x["overhead_pct"] for x in runs[p]]
        us = [x["overhead_us"] for x in runs[p]]
        waits = sum(int((x.get("ring") or {}).get("full_waits") or 0) for x in runs[p])
        print(f"| {p} | {statistics.median(pct):+.1f}% | {', '.join(f'{v:+.1f}%' for v in pct)} | {statistics.median(us):+.0f} µs | {waits} |")
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
