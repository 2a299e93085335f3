"""Where the recorder's time goes: the MTP engine's decode step, plain and recorded, profiled.

Prints, for one configuration: the median plain and recorded step, the median time the step
thread spends inside the recorder before and after the original step (and, in ``step``
durability, waiting for the writer), then the functions that cost the most on the step thread
and on the writer thread (cProfile, ``tottime``). A development tool: ``bench_record.py`` gives
the figures for RESULTS.md.

    python benchmarks/profile_record.py --device cuda --preset small --durability step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--durability", default="step", choices=["step", "async"], help="without the ring only")
    ap.add_argument("--no-ring", action="store_true", help="the writer-thread path (before issue 15)")
    ap.add_argument("--lag", type=float, default=None, help="drain_lag_s (default: the config's)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    device = args.device
    preset = args.preset or ("small" if device.startswith("cuda") else "tiny")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    from replay.record import recorder as recorder_mod
    from replay.record import writer as writer_mod
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    # Python 3.12's cProfile is process-wide (sys.monitoring): one profiler may run at a time, so
    # the writer thread is timed per job, and profiled only where profilers are per thread.
    per_thread = sys.version_info < (3, 12)
    writer_prof = cProfile.Profile() if per_thread else None
    writer_jobs: list[float] = []
    orig_run, orig_write = writer_mod.Writer._run, writer_mod.Writer._write

    def profiled_run(self):
        if writer_prof is not None:
            writer_prof.enable()
        try:
            orig_run(self)
        finally:
            if writer_prof is not None:
                writer_prof.disable()

    def timed_write(self, job):
        t0 = time.perf_counter()
        try:
            return orig_write(self, job)
        finally:
            if job.kind == recorder_mod.FrameKind.STEP:
                writer_jobs.append(time.perf_counter() - t0)

    writer_mod.Writer._run = profiled_run
    writer_mod.Writer._write = timed_write
    # Time the step thread spends waiting for the writer (durability "step").
    waits: list[float] = []
    orig_submit = recorder_mod.Recorder._submit

    def timed_submit(self, job, *, wait):
        t0 = time.perf_counter()
        try:
            return orig_submit(self, job, wait=wait)
        finally:
            if job.kind == recorder_mod.FrameKind.STEP:
                waits.append(time.perf_counter() - t0)

    recorder_mod.Recorder._submit = timed_submit

    cfg = {"preset": preset, "cudagraph": not args.no_graphs, "device": device, "batch": 8 if preset == "small" else 4}
    engine = build_engine(cfg, rank=0, world_size=1, device=device, options={})
    engine.prefill()
    if cfg["cudagraph"]:
        engine.capture_graphs()
    plain = Engine.decode_step
    inner: list[float] = []

    def timed_plain(*a, **k):
        t0 = time.perf_counter()
        try:
            return plain(*a, **k)
        finally:
            inner.append(time.perf_counter() - t0)

    Engine.decode_step = timed_plain
    extra = {}
    if args.lag is not None:
        extra["drain_lag_s"] = args.lag
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings(durability=args.durability, record_ring_mib=0 if args.no_ring else 64, **extra))
        session.install()
        recorded = Engine.decode_step

        def run(fn, n: int, prof: cProfile.Profile | None = None) -> list[float]:
            times = []
            for _ in range(n):
                inputs = engine.step_inputs()
                sync()
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                out = fn(engine, *inputs)
                out.accepted.tolist()
                if prof is not None:
                    prof.disable()
                times.append(time.perf_counter() - t0)
                engine.advance(out)
            return times

        run(plain, 10)
        run(recorded, 10)
        t_plain = run(plain, args.steps)
        inner.clear()
        waits.clear()
        writer_jobs.clear()
        t_rec = run(recorded, args.steps)
        inner_rec = list(inner)
        waits_rec = list(waits)
        jobs_rec = list(writer_jobs)
        main_prof = cProfile.Profile()
        run(recorded, args.steps, main_prof)
        err = session.recorder.error if session.recorder is not None else None
        ring = session.recorder.ring_stats() if session.recorder is not None else None
        session.shutdown()
        session.disabled = True
    mp, mr = statistics.median(t_plain), statistics.median(t_rec)
    mi = statistics.median(inner_rec)
    print(f"{device} {preset} graphs={'on' if cfg['cudagraph'] else 'off'} durability={args.durability} steps={args.steps} recorder_error={err}")
    print(f"ring {ring} extra={extra}")
    print(f"plain step        {mp * 1e3:8.3f} ms")
    print(f"recorded step     {mr * 1e3:8.3f} ms  ({100 * (mr - mp) / mp:+.1f}%)")
    print(f"  original step inside the wrapper {mi * 1e3:8.3f} ms (host time until it returned)")
    print(f"  end_step submit (+ wait)          {statistics.median(waits_rec) * 1e3:8.3f} ms")
    if jobs_rec:  # the writer-thread path (--no-ring) only: the ring's drain has no per-step job here
        print(f"  writer thread, one step's job     {statistics.median(jobs_rec) * 1e3:8.3f} ms (event wait included)")
    profiles = [("step thread" if per_thread else "all threads", main_prof)]
    if writer_prof is not None and writer_prof.getstats():  # empty on the ring path: no writer thread ran
        profiles.append(("writer thread", writer_prof))
    for title, prof in profiles:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"\n== {title} (cProfile, {args.steps} recorded steps) ==")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
        # The recorder's own functions by cumulative time: what a step pays for being recorded.
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(r"replay/(record|core|digest|format)", args.top)
        print(f"\n== {title}: the recorder's functions (cumulative) ==")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
