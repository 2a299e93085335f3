"""CUDA runtime calls of one recorded decode step, by recorder phase (a development tool).

The host cost of an eager CUDA step grows with every launch, copy and event the recorder queues.
This counts them: it profiles plain and recorded steps of the ``mtp`` engine with
``torch.profiler`` and, for each CUDA runtime or driver call on the host (``cudaLaunchKernel``,
``cudaMemcpyAsync``, ``cudaEventRecord``, ``cuLaunchKernel`` for Triton, ``cudaGraphLaunch``...),
names the recorder phase it was made in (the innermost of the labelled entry points).

    python3 benchmarks/diag/step_ops.py               # eager CUDA, small preset
    python3 benchmarks/diag/step_ops.py --graphs
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections import Counter
from pathlib import Path

import torch

PHASES = (
    ("Session", "_early_step"), ("Session", "_before_step"), ("Recorder", "begin_step"), ("Recorder", "record_inputs"),
    ("Recorder", "record_outputs"), ("Recorder", "record_probe"), ("Recorder", "record_logits"), ("Recorder", "end_step"),
    ("Staging", "input_snapshots"), ("Staging", "place_pending"), ("Staging", "stage"), ("Staging", "seal_job"),
    ("SidePlans", "run"),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from replay.record.recorder import Recorder
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.record.side_plan import SidePlans
    from replay.record.staging import Staging
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    owners = {"Session": Session, "Recorder": Recorder, "Staging": Staging, "SidePlans": SidePlans}
    cfg = {"preset": args.preset, "cudagraph": args.graphs, "device": "cuda", "batch": 8, "buckets": [8]}
    engine = build_engine(cfg, rank=0, world_size=1, device="cuda", options={})
    engine.prefill()
    if args.graphs:
        engine.capture_graphs()
    plain = Engine.decode_step

    def run(fn, n: int) -> None:  # noqa: ANN001
        for _ in range(n):
            inputs = engine.step_inputs()
            out = fn(engine, *inputs)
            out.accepted.tolist()
            engine.advance(out)

    def count(fn) -> Counter:  # noqa: ANN001
        run(fn, 10)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(fn, args.steps)
        c: Counter = Counter()
        for ev in prof.events():
            name = ev.name
            if not (name.startswith("cuda") or name.startswith("cu")) or name.startswith("cudnn"):
                continue
            phase, p = "program", ev.cpu_parent
            while p is not None:
                if p.name.startswith("phase:"):
                    phase = p.name[6:]
                    break
                p = p.cpu_parent
            c[(phase, name)] += 1
        return c

    with tempfile.TemporaryDirectory() as tmp:
        base = count(plain)
        session = Session(Path(tmp), RecordSettings())
        session.install()
        recorded = Engine.decode_step
        for owner, name in PHASES:
            cls = owners[owner]
            orig = getattr(cls, name)

            def wrapped(*a, __orig=orig, __label=f"phase:{owner}.{name}", **k):  # noqa: ANN002, ANN003, ANN202
                with torch.profiler.record_function(__label):
                    return __orig(*a, **k)

            setattr(cls, name, functools.wraps(orig)(wrapped))
        rec_c = count(recorded)
        n = args.steps
        print(f"{args.preset} graphs={'on' if args.graphs else 'off'} steps={n}: CUDA API calls per step")
        tot_p = sum(base.values()) / n
        tot_r = sum(rec_c.values()) / n
        print(f"  plain {tot_p:.1f}   recorded {tot_r:.1f}   added {tot_r - tot_p:+.1f}")
        by_phase: Counter = Counter()
        for (phase, _name), k in rec_c.items():
            by_phase[phase] += k
        for phase, k in sorted(by_phase.items(), key=lambda kv: -kv[1]):
            names = ", ".join(f"{nm} {v / n:.1f}" for (ph, nm), v in sorted(rec_c.items(), key=lambda kv: -kv[1]) if ph == phase)
            print(f"  {phase:28s} {k / n:6.1f}   ({names})")
        rec = session.recorder
        if rec is not None:
            plans = rec._staging.plans
            print(f"recorder error: {rec.error}; side graphs captured: {plans.captured}; plan failure: {plans.failure}")
        session.shutdown()
        session.disabled = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
