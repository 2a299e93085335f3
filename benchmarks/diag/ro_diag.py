"""Diagnosis of the reduce-overhead re-run (issue 14) on a GPU: recorded digests per step, the
program's own digests without the recorder, and the re-run's (eager and cudagraph)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tests" / "engines" / "tinyllm"
OUT = Path(os.environ.get("OUT", "/tmp"))
env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_RECORD_")}
env["PYTHONPATH"] = str(ROOT)
args = ["--tokens", "12", "--compile", "--compile-mode", "reduce-overhead", "--device", "cuda"]


def sh(cmd, cwd=ENGINE, timeout=300):
    t = time.time()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(map(str, cmd))[:150]}  rc={p.returncode} {time.time() - t:.0f}s", flush=True)
    return p


rec = OUT / "ro"
p = sh([sys.executable, "-m", "replay", "record", "--out", str(rec), "--quiet", "--", sys.executable, "generate.py", *args])
print(p.stderr[-1500:])
sys.path.insert(0, str(ROOT))
from replay.format.reader import Recording  # noqa: E402

with Recording(rec) as r:
    rf = list(r.values())[0][0]
    for s in range(rf.n_steps):
        v = rf.step(s)
        f = dict(v.fields())
        print("REC", s, v.mode, {k: f"{x:016x}" for k, x in f.items() if k.startswith(("output", "input"))}, flush=True)
for mode in ("reduce-overhead", "default"):
    a = list(args)
    a[a.index("reduce-overhead")] = mode if mode != "default" else "default"
    p = sh([sys.executable, str(ROOT / "benchmarks/diag/truth_logits.py"), str(ENGINE), *a])
    print(mode, [ln for ln in p.stdout.splitlines() if ln.startswith(("TRUTH", "tokens"))], p.stderr[-500:])
p = sh([sys.executable, "-m", "replay", "step", str(rec), "--rank", "0", "--step", "8", "--mode", "both", "--device", "cuda:0",
        "--json", "--no-save"], cwd=OUT)
(OUT / "step.json").write_text(p.stdout)
try:
    d = json.loads(p.stdout)
    for m, run in d["modes"].items():
        print("RERUN", m, run["ran_as"], run["digests"], "departed", run["departed"], "caught_up", run["caught_up"],
              "ctx", run["numerics"], {k: v["verdict"] for k, v in run["vs_recording"].items()})
    print("notes", d["notes"], d.get("verdicts"))
except Exception as e:  # noqa: BLE001
    print("no json", e, p.stderr[-2000:])
