"""Host time of each recorder phase of a recorded decode step (a development tool).

Wraps the session's and recorder's per-step entry points with timers and reports, per step, the
host microseconds spent before the program's step is called (``_before_step``), in the program's
own call, in ``record_outputs`` and ``end_step``, and the step's time to its natural sync; then the
same with parts switched off (RNG state, inputs, outputs' device work).

    python3 benchmarks/diag/host_phases.py            # CUDA graphs, small preset
    python3 benchmarks/diag/host_phases.py --no-graphs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fine", action="store_true", help="also the parts of end_step and of the probe")
    ap.add_argument("--torch-ops", action="store_true", help="also every Tensor.copy_/add_/clone/view/[] call (the program's too)")
    ap.add_argument("--no-defer", action="store_true", help="the record's device work on the program's stream")
    ap.add_argument("--no-early", action="store_true", help="all bookkeeping before the call (no early path)")
    ap.add_argument("--no-rng", action="store_true", help="no RNG state per step")
    ap.add_argument("--no-static", action="store_true", help="fresh snapshots: no graph of the side work")
    args = ap.parse_args()
    from replay.record.recorder import Recorder
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    from replay.record.staging import Staging

    Staging.DEFER = not args.no_defer
    Staging.STATIC_SNAPSHOTS = not args.no_static
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = {"preset": args.preset, "cudagraph": not args.no_graphs, "device": args.device, "batch": 8, "buckets": [8]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    if cfg["cudagraph"]:
        engine.capture_graphs()
    plain = Engine.decode_step
    acc: dict[str, list[float]] = defaultdict(list)

    def timed(owner, name, label):  # noqa: ANN001, ANN202
        orig = getattr(owner, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[label].append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)

    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings(**({"rng": False} if args.no_rng else {})))
        Session.early_path = not args.no_early
        session.install()
        recorded = Engine.decode_step
        from replay.record.staging import Staging

        for owner, name in ((Session, "_before_step"), (Session, "_early_step"), (Recorder, "begin_step"), (Recorder, "record_inputs"),
                            (Recorder, "record_args"), (Recorder, "record_outputs"), (Recorder, "end_step"),
                            (Session, "_set_run"), (Recorder, "record_probe"), (Recorder, "record_logits"),
                            (Staging, "stage"), (Staging, "place_pending"), (Recorder, "_submit_ring"),
                            (Staging, "seal_job")):
            timed(owner, name, f"{owner.__name__}.{name}")
        if args.fine:
            # The parts of end_step and of the probe, one level down.
            import replay.record.recorder as recorder_mod
            from replay.record.ring import ShmRing
            from replay.record.side_plan import SidePlans
            from replay.record.job_meta import MetaText

            for owner, name in ((Staging, "_enter_side"), (Staging, "_stage_tail"), (Staging, "_stage"), (Staging, "leave_side"),
                                (Staging, "_place_area"), (Staging, "entries"), (Staging, "snapshot"), (SidePlans, "run"),
                                (ShmRing, "alloc"), (ShmRing, "write_job_header"), (Recorder, "_logits"), (Recorder, "_submit"),
                                (recorder_mod, "job_meta"), (Recorder, "_stage_collectives"), (Staging, "_host_for"),
                                (Staging, "_copy_cpu"), (Staging, "_pack_into_area"), (Recorder, "_submit_step"),
                                (Recorder, "_stage_device"), (MetaText, "encode"), (MetaText, "_template")):
                timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
        if args.torch_ops:
            # Every call of these, the program's own included (its count a step says which).
            for name in ("copy_", "add_", "clone", "view", "__getitem__"):
                timed(torch.Tensor, name, f"Tensor.{name}")
        # The parts of the early path (before the call) and of begin_step.
        import replay.numerics as numerics_mod
        import replay.record.rng as rng_mod
        import replay.record.session as session_mod
        from replay.record.calls import Binder

        if args.fine:
            # Binding and splitting the step's arguments (before the call, or after it on the early path).
            timed(session_mod, "split_arguments", "split_arguments")
            timed(Binder, "bind", "Binder.bind")

        for owner, name, label in ((numerics_mod, "current", "numerics.current"), (rng_mod, "capture_rng", "capture_rng"),
                                   (Recorder, "early_ok", "Recorder.early_ok"), (Session, "_find_stream", "Session._find_stream"),
                                   (Staging, "input_snapshots", "Staging.input_snapshots"),
                                   (torch, "_foreach_copy_", "torch._foreach_copy_")):
            timed(owner, name, label)
        # The program's own call, as the wrapper sees it.
        inner = {"fn": plain}

        # When the program's own step body starts (its first call, ``_forward``): the host time
        # the recorder spends before the program's work is queued.
        entered: list[float] = []
        forward = engine._forward

        def forward_entry(*a, **k):  # noqa: ANN002, ANN003, ANN202
            entered.append(time.perf_counter())
            return forward(*a, **k)

        engine._forward = forward_entry

        def run(fn, n: int) -> list[tuple[float, float, float]]:  # noqa: ANN001
            times = []
            for _ in range(n):
                inputs = engine.step_inputs()
                sync()
                entered.clear()
                t0 = time.perf_counter()
                out = fn(engine, *inputs)
                t1 = time.perf_counter()
                out.accepted.tolist()
                t2 = time.perf_counter()
                times.append((t1 - t0, t2 - t0, entered[0] - t0 if entered else float("nan")))
                engine.advance(out)
            return times

        run(plain, 10)
        run(recorded, 10)
        acc.clear()
        tp = run(plain, args.steps)
        tr = run(recorded, args.steps)
        n = args.steps
        med = lambda xs, i: statistics.median(x[i] for x in xs) * 1e6  # noqa: E731
        print(f"{args.preset} graphs={'on' if cfg['cudagraph'] else 'off'} steps={n}")
        print(f"  plain:    until the body {med(tp, 2):7.1f} us   host until return {med(tp, 0):8.1f} us   until sync {med(tp, 1):8.1f} us")
        print(f"  recorded: until the body {med(tr, 2):7.1f} us   host until return {med(tr, 0):8.1f} us   until sync {med(tr, 1):8.1f} us")
        for k, v in acc.items():
            print(f"  {k:28s} median {statistics.median(v) * 1e6:8.1f} us  mean {sum(v) / len(v) * 1e6:8.1f} us  calls/step {len(v) / n:.1f}")
        if cuda and args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(recorded, 20)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
        rec = session.recorder
        if rec is not None:
            plans = rec._staging.plans
            print(f"recorder error: {rec.error}; side graphs captured: {plans.captured}; plan failure: {plans.failure}")
        session.shutdown()
        session.disabled = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
