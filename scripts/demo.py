"""`make demo`: record the reference engine drifting on CPU, find the divergence, re-run the step.

Every step is a real `replay` command, printed before it runs, so the demo doubles as a tour:

1. `replay record -- python -m replay.workloads.mtp ...`: four replicated ranks decode with MTP
   speculative decoding under the (CPU) graph runner; rank 2's tuner is forced onto a different
   MoE combine tactic, as an unsynchronised autotuner would leave it. The ranks' logits differ in
   their last bits from the first step; at a near-tie a token flips, the ranks accept different
   numbers of drafts, and the engine stops with its rank-drift error (exit code 3), as the real
   bug does.
2. `replay info`: the first divergence (bits), the first token divergence, the margin there,
   and the tuner choice and graph kernels that differ.
3. `replay step --rank R --step S --mode both`: re-run the divergent step of the odd rank, eagerly
   and under the graph runner, from the nearest keyframe, against every rank's recording.
4. `replay bisect ... --between rank:A,rank:B`: the first module whose output differs.
5. `replay report`: the HTML report.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], *, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    shown = " ".join(shlex.quote(a) for a in (["replay", *args[3:]] if args[:3] == [sys.executable, "-m", "replay"] else args))
    print(f"\n$ {shown}", flush=True)
    p = subprocess.run(args, cwd=ROOT, text=True, capture_output=capture)
    if capture and p.stdout and not p.stdout.lstrip().startswith("{"):
        print(p.stdout, end="")
    if check and p.returncode != 0:
        if capture:
            print(p.stderr, file=sys.stderr)
        raise SystemExit(f"demo: `{shown}` failed with exit code {p.returncode}")
    return p


def replay(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "replay", *args], **kw)


def main() -> int:
    out = ROOT / "recordings" / f"{time.strftime('%Y%m%d-%H%M%S')}-demo-mtp-drift"
    engine = [sys.executable, "-m", "replay.workloads.mtp", "--ranks", "4", "--steps", "300", "--cudagraph",
              "--force-tactic", "2:moe_combine:bf16"]
    p = replay("record", "--out", str(out), "--keyframe-every", "20", "--quiet", "--", *engine, check=False)
    if p.returncode not in (0, 3):
        raise SystemExit(f"demo: recording failed (exit code {p.returncode})")
    print(f"\n(the engine exited with code {p.returncode}: 3 is its rank-drift error, the crash users meet)")
    replay("info", str(out))
    info = json.loads(replay("info", str(out), "--json", capture=True).stdout)
    div = info["first_token_divergence"] or info["first_divergence"]
    if div is None:
        print("demo: the ranks did not diverge this time")
        return 0
    odd, step = div["ranks"][0], div["step"]
    good = div["majority"][0]
    p = replay("step", str(out), "--rank", str(odd), "--step", str(step), "--mode", "both", check=False)
    if p.returncode not in (0, 7):
        raise SystemExit(f"demo: `replay step` failed with exit code {p.returncode}")
    if p.returncode == 7:
        print("\n(exit code 7: `replay step` never exits 0 for a step that raised or could not be compared; its last line says which)")
    if (ROOT / "replay" / "cli" / "bisect.py").exists():
        replay("bisect", str(out), "--rank", str(odd), "--step", str(step), "--between", f"rank:{good},rank:{odd}", check=False)
    replay("report", str(out))
    print(f"\ndemo: recording {out.relative_to(ROOT)}; open {out.relative_to(ROOT)}/report.html in a browser")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
