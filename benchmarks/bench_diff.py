"""How fast `replay diff A B` compares two runs: 8 ranks x 100,000 steps each by default.

Both recordings are synthesised straight into rank tables, as `bench_info.py` does (12 fields a
step: inputs, a graph, collectives, outputs, tokens; digests only); in B one rank departs 1,234
steps before the end. Timed: the library call (open both, compare every stream and everything
else), and the whole `replay diff A B --json` command in a fresh process. The result is checked:
the first difference must be the one planted.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_info import synth  # noqa: E402  (same synthetic recordings as the info benchmark)

GOAL_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from replay.analysis.diff import diff

    odd, at = 5 % args.ranks, max(0, args.steps - 1234)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        t0 = time.perf_counter()
        synth(a, args.ranks, args.steps, diverge_rank=-1, diverge_at=at)  # no rank departs
        synth(b, args.ranks, args.steps, diverge_rank=odd, diverge_at=at)
        t_synth = time.perf_counter() - t0
        size = sum(f.stat().st_size for d in (a, b) for f in d.rglob("*") if f.is_file())
        best_lib = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            r = diff(str(a), str(b))
            best_lib = min(best_lib, time.perf_counter() - t0)
        first = r.first
        assert first is not None and (first[0].rank_a, first[1].step, first[1].field) == (odd, at, "output.logits"), r.headline
        cli = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "replay", "diff", str(a), str(b), "--json"], capture_output=True, text=True)
            cli = min(cli, time.perf_counter() - t0)
        assert p.returncode == 1, p.stderr  # different, as diff(1)
        out = json.loads(p.stdout)
        assert out["first_difference"]["step"] == at, out["headline"]
    row = {
        "ranks": args.ranks,
        "steps": args.steps,
        "recordings_mb": round(size / 1e6, 1),
        "diff_library_s": round(best_lib, 3),
        "diff_command_s": round(cli, 3),
        "goal_s": GOAL_S,
        "headline": out["headline"],
        "machine": platform.processor() or platform.machine(),
        "synth_s": round(t_synth, 1),
    }
    if args.json:
        print(json.dumps(row))
    else:
        print("| ranks x steps, each run | both recordings | `diff` (library) | `replay diff A B --json` (whole command) | goal |")
        print("|---|---|---|---|---|")
        print(f"| {args.ranks} x {args.steps:,} | {row['recordings_mb']} MB | {row['diff_library_s']} s | {row['diff_command_s']} s | < {GOAL_S:g} s |")
        print(f"\nfirst line: {row['headline']}")
    return 0 if cli < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
