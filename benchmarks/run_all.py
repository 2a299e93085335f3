"""`make bench`: every benchmark, side by side, with the machine and the command of each.

Writes the combined markdown to stdout and to benchmarks/results/<date>-<machine>.md; the
figures quoted in benchmarks/RESULTS.md are copied from such a file.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()

BENCHES = [
    ("digest throughput", ["benchmarks/bench_digest.py"]),
    ("recorder overhead and writer throughput", ["benchmarks/bench_record.py"]),
    ("finding the first divergence (8 ranks x 100,000 steps)", ["benchmarks/bench_info.py"]),
    ("comparing two runs: replay diff (8 ranks x 100,000 steps each)", ["benchmarks/bench_diff.py"]),  # issue 17
    ("re-running a step: early vs late", ["benchmarks/bench_rerun.py"]),
    ("reference engine: eager vs graphs", ["benchmarks/bench_mtp.py"] + (["--device", "cuda", "--preset", "small"] if GPU else [])),
]


def main() -> int:
    only = set(sys.argv[1:])
    machine = torch.cuda.get_device_name(0) if GPU else (platform.processor() or platform.machine())
    lines = [f"# make bench — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine} — torch {torch.__version__}", ""]
    failed = 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for title, cmd in BENCHES:
        if only and not any(o in cmd[0] for o in only):
            continue
        if not (ROOT / cmd[0]).exists():
            lines += [f"## {title}", "", f"(skipped: {cmd[0]} is missing)", ""]
            continue
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        lines += [f"## {title}", "", f"`python {' '.join(cmd)}` ({dt:.0f} s)", ""]
        lines += [p.stdout.strip() if p.returncode == 0 else f"FAILED (exit {p.returncode}):\n```\n{p.stderr[-1500:]}\n```", ""]
        failed += p.returncode != 0
        print("\n".join(lines[-4:]), flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{time.strftime('%Y%m%d-%H%M')}-{machine}")[:80]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"\nwritten to benchmarks/results/{name}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
