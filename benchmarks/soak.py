"""Soak: record 8 CPU ranks for many thousands of steps through `replay record`; memory must stay flat.

    python benchmarks/soak.py                      # 8 ranks x 20,000 steps, markdown table
    python benchmarks/soak.py --steps 2000 --json  # shorter, JSON

The program is ``tests/scripts/gloo_ranks.py``: each rank runs a small step (a 16x16 matmul and
one gloo all_reduce) and logs each step it completes. The recorder keeps every step's input in
full, the output's digest, the collective's digests, the RNG state and a state keyframe every 50
steps, with durability "step" (a step is in the journal when it returns).

While it runs, each rank's resident memory (VmRSS) is sampled. Reported per rank: steps, steps/s,
RSS at 5% of the run (after warm-up), at the end, the maximum, and the growth in between. Then
every rank's recording is checked: all steps there, in order, sealed, and ``replay verify``
(``--full-verify`` re-digests every stored tensor; the default checks structure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "tests" / "scripts" / "gloo_ranks.py"
STEP = "gloo_engine:Engine.step"


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


def soak(out: Path, *, ranks: int, steps: int, sample_s: float, full_verify: bool, timeout_s: float,
         record: bool = True) -> dict[str, Any]:
    """Run the program (under `replay record` unless ``record`` is False: the baseline)."""
    prog, rec = out / "prog", out / "rec"
    cmd = [sys.executable, str(LAUNCH), "--dir", str(prog), "--world", str(ranks), "--steps", str(steps),
           "--log", "count", "--pg-timeout", "300"]
    if record:
        cmd = [sys.executable, "-m", "replay", "record", "--out", str(rec), "--quiet", "--step", STEP, "--state",
               "state", "--", *cmd]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t0 = time.monotonic()
    with open(out / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=out, stdout=subprocess.DEVNULL, stderr=err, env=env)
        # samples[rank] = [(seconds, steps completed, rss MB)]
        samples: dict[int, list[tuple[float, int, float]]] = {r: [] for r in range(ranks)}
        pids: dict[int, int] = {}
        first_step: dict[int, float] = {}
        last_step: dict[int, float] = {}
        while proc.poll() is None:
            now = time.monotonic() - t0
            if now > timeout_s:
                proc.kill()
                raise SystemExit(f"soak: did not finish in {timeout_s:.0f} s")
            for r in range(ranks):
                if r not in pids:
                    try:
                        pids[r] = int((prog / f"pid-{r}").read_text())
                    except (OSError, ValueError):
                        continue
                n = count_lines(prog / f"progress-{r}.txt")
                m = rss_mb(pids[r])
                if n and r not in first_step:
                    first_step[r] = now
                if n >= steps and r not in last_step:
                    last_step[r] = now
                if m is not None:
                    samples[r].append((now, n, m))
            time.sleep(sample_s)
        code = proc.wait()
    wall = time.monotonic() - t0
    per_rank = []
    for r in range(ranks):
        s = [x for x in samples[r] if x[1] > 0]
        done = count_lines(prog / f"progress-{r}.txt")
        # While stepping, after a warm-up: the close at the end (which seals, reading the whole
        # journal once) is reported by the maximum, not mistaken for growth.
        warm = [x for x in s if 0.05 * steps <= x[1] < steps] or s
        start, end = (warm[0][2], warm[-1][2]) if warm else (float("nan"), float("nan"))
        dur = last_step.get(r, wall) - first_step.get(r, 0.0)
        per_rank.append({
            "rank": r, "steps": done, "seconds": round(dur, 1), "steps_per_s": round(done / dur, 1) if dur > 0 else None,
            "rss_start_mb": round(start, 1), "rss_end_mb": round(end, 1),
            "rss_max_mb": round(max((x[2] for x in s), default=float("nan")), 1),
            "rss_growth_mb": round(end - start, 1), "samples": len(s),
            "rss_series": [(round(t, 1), n, round(m, 1)) for t, n, m in s[:: max(1, len(s) // 20)]],
        })
    res: dict[str, Any] = {"exit_code": code, "wall_s": round(wall, 1), "ranks": per_rank}
    if record:
        res.update(check(rec, ranks, steps, full_verify))
        res["bytes_written"] = sum(p.stat().st_size for p in rec.rglob("*") if p.is_file())
    return res


def check(rec: Path, ranks: int, steps: int, full_verify: bool) -> dict[str, Any]:
    """Every rank's recording: how many steps, in order, sealed; and what `replay verify` says."""
    from replay import open_recording

    kept: dict[str, int] = {}
    problems: list[str] = []
    with open_recording(rec) as r:
        parts = list(r.values())
        if len(parts) != 1:
            problems.append(f"{len(parts)} parts")
        for part in parts:
            for rank in range(ranks):
                if rank not in part:
                    problems.append(f"rank {rank}: no file")
                    continue
                rf = part[rank]
                s = rf.tables.steps["step"]
                kept[str(rank)] = int(s.size)
                if list(s) != list(range(steps)):
                    problems.append(f"rank {rank}: {s.size} steps kept of {steps}")
                if not rf.sealed or not rf.complete:
                    problems.append(f"rank {rank}: not sealed and complete")
    args = [sys.executable, "-m", "replay", "verify", "--json", str(rec)] + ([] if full_verify else ["--quick"])
    t = time.monotonic()
    v = subprocess.run(args, capture_output=True, text=True)
    return {"kept_steps": kept, "problems": problems, "verify_exit": v.returncode,
            "verify": "full" if full_verify else "quick", "verify_s": round(time.monotonic() - t, 1)}


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Soak: {args.ranks} ranks x {args.steps} steps on CPU (gloo), through `replay record`; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "",
        "RSS start/end: at 5% of the steps and at the last step; growth: between the two; max: over the whole run,",
        "including the close, which seals the rank file.",
        "",
        "| rank | steps | seconds | steps/s | RSS start MB | RSS end MB | RSS max MB | growth MB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["ranks"]:
        lines.append(f"| {r['rank']} | {r['steps']} | {r['seconds']} | {r['steps_per_s']} | {r['rss_start_mb']} | "
                     f"{r['rss_end_mb']} | {r['rss_max_mb']} | {r['rss_growth_mb']:+} |")
    lost = sum(args.steps - r["steps"] for r in res["ranks"]) + sum(
        max(0, r["steps"] - res["kept_steps"].get(str(r["rank"]), 0)) for r in res["ranks"])
    lines += [
        "",
        f"- exit code {res['exit_code']}, wall {res['wall_s']} s, {res['bytes_written'] / 1e6:.1f} MB written "
        f"({res['bytes_written'] / max(1, args.ranks * args.steps):.0f} bytes per rank-step)",
        f"- steps kept: {sum(res['kept_steps'].values())} of {args.ranks * args.steps}; lost: {lost}; "
        f"`replay verify` ({res['verify']}): exit {res['verify_exit']} in {res['verify_s']} s",
        f"- max RSS growth of a rank: {max(r['rss_growth_mb'] for r in res['ranks']):+.1f} MB",
    ]
    if res["problems"]:
        lines.append(f"- problems: {'; '.join(res['problems'])}")
    b = res.get("baseline")
    if b:
        rate = sum(r["steps_per_s"] or 0 for r in b["ranks"]) / len(b["ranks"])
        rec_rate = sum(r["steps_per_s"] or 0 for r in res["ranks"]) / len(res["ranks"])
        lines.append(f"- without the recorder: {rate:.1f} steps/s per rank (recorded: {rec_rate:.1f}); RSS growth "
                     f"max {max(r['rss_growth_mb'] for r in b['ranks']):+.1f} MB, end {max(r['rss_end_mb'] for r in b['ranks']):.1f} MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--sample", type=float, default=0.5, help="Seconds between RSS samples.")
    p.add_argument("--out", type=Path, default=None, help="Where to record (default: a temporary directory, removed).")
    p.add_argument("--full-verify", action="store_true", help="Re-digest every stored tensor.")
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--baseline", action="store_true", help="Also run the program without the recorder, for comparison.")
    p.add_argument("--json", action="store_true", help="Print JSON instead of the markdown table.")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="replay-soak-"))
    (out / "recorded").mkdir(parents=True, exist_ok=True)
    (out / "baseline").mkdir(parents=True, exist_ok=True)
    try:
        res = soak(out / "recorded", ranks=args.ranks, steps=args.steps, sample_s=args.sample,
                   full_verify=args.full_verify, timeout_s=args.timeout)
        if args.baseline:
            res["baseline"] = soak(out / "baseline", ranks=args.ranks, steps=args.steps, sample_s=args.sample,
                                   full_verify=False, timeout_s=args.timeout, record=False)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    res["config"] = {"ranks": args.ranks, "steps": args.steps, "cpus": os.cpu_count(), "python": platform.python_version()}
    print(json.dumps(res, indent=2) if args.json else markdown(res, args))
    ok = res["exit_code"] == 0 and not res["problems"] and res["verify_exit"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
