"""How long `replay step` takes: it should cost the keyframe interval, not the step's index.

Records the reference engine (tiny preset on CPU by default) for N steps with keyframes every K,
then times `replay step --mode eager` on an early step and on a late one, each as a whole
command in a fresh process (start-up included), plus the start-up alone (a step that is its own
keyframe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--keyframe-every", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "rec"
        t_rec, p = run([sys.executable, "-m", "replay", "record", "--out", str(rec), "--quiet", "--keyframe-every",
                        str(args.keyframe_every), "--", sys.executable, "-m", "replay.workloads.mtp", "--ranks", "1",
                        "--steps", str(args.steps), "--device", args.device, "--preset", args.preset, "--cudagraph"], env)
        if p.returncode != 0:
            print(p.stderr[-2000:], file=sys.stderr)
            return 1
        k = args.keyframe_every
        early, late, own = 10, args.steps - 10, (args.steps // k - 1) * k
        times: dict[str, list[float]] = {"early": [], "late": [], "startup": []}
        for _ in range(args.repeat):
            for name, step in (("early", early), ("late", late), ("startup", own)):
                dt, p = run([sys.executable, "-m", "replay", "step", str(rec), "--rank", "0", "--step", str(step), "--mode",
                             "eager", "--device", args.device, "--no-save", "--json"], env)
                if p.returncode != 0:
                    print(p.stderr[-2000:], file=sys.stderr)
                    return 1
                data = json.loads(p.stdout)
                assert data["modes"]["eager"]["departed"] is None
                times[name].append(dt)
    med = {k_: statistics.median(v) for k_, v in times.items()}
    row = {
        "steps": args.steps, "keyframe_every": k, "device": args.device, "preset": args.preset,
        "record_s": round(t_rec, 1),
        "step_early": early, "early_s": round(med["early"], 2),
        "step_late": late, "late_s": round(med["late"], 2),
        "startup_step": own, "startup_s": round(med["startup"], 2),
        "late_over_early": round(med["late"] / med["early"], 2),
    }
    if args.json:
        print(json.dumps(row))
        return 0
    print(f"| recording | `replay step` on step {early} | on step {late} | ratio | start-up (a keyframe step, {own}) |")
    print("|---|---|---|---|---|")
    print(f"| {args.preset} on {args.device}, {args.steps} steps, keyframes every {k} | {row['early_s']} s | {row['late_s']} s | "
          f"{row['late_over_early']} | {row['startup_s']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
