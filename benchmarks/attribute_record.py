"""Where a recorded CUDA step's extra time goes (a development tool; RESULTS.md figures come from
``bench_record.py``).

Alternating blocks, like ``bench_record.py``: the plain step, the recorded step, and the recorded
step with parts of the recorder switched off (the drain thread's writes, the margin and logits
ring), then a ``torch.profiler`` trace of recorded steps: device time per kernel, so that the
record's own kernels and copies can be told from the program's.

    python benchmarks/attribute_record.py --preset small            # CUDA graphs
    python benchmarks/attribute_record.py --preset small --no-graphs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=None, help="default: small on CUDA, tiny on CPU")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=25)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--more", action="store_true", help="also: the drain neither waits nor writes; gc off; blocking events")
    ap.add_argument("--no-profile", action="store_true", help="no torch.profiler tables")
    args = ap.parse_args()
    from replay.record import writer as writer_mod
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("small" if cuda else "tiny")
    batch = 8 if cuda else 4
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = {"preset": args.preset, "cudagraph": not args.no_graphs, "device": args.device, "batch": batch, "buckets": [batch]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    if cfg["cudagraph"]:
        engine.capture_graphs()
    plain = Engine.decode_step
    orig_write = writer_mod.Writer._write
    drain_on = [True]
    drain_waits = [True]

    def write(self, job):  # noqa: ANN001, ANN202
        if drain_on[0]:
            return orig_write(self, job)
        if job.event is not None and drain_waits[0]:
            job.event.synchronize()
        return None

    writer_mod.Writer._write = write
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings())
        session.install()
        recorded = Engine.decode_step
        rec = session.ensure_recorder()

        def run(fn, n: int) -> list[float]:
            times = []
            for _ in range(n):
                inputs = engine.step_inputs()
                sync()
                t0 = time.perf_counter()
                out = fn(engine, *inputs)
                out.accepted.tolist()
                times.append(time.perf_counter() - t0)
                engine.advance(out)
            return times

        def no_drain(e, *a):  # noqa: ANN001, ANN202
            drain_on[0] = False
            try:
                return recorded(e, *a)
            finally:
                drain_on[0] = True

        def no_margin(e, *a):  # noqa: ANN001, ANN202
            rec._logits = lambda *_: None  # no top-2 margin, no logits ring
            try:
                return recorded(e, *a)
            finally:
                del rec._logits

        def short_switch(e, *a):  # noqa: ANN001, ANN202
            old = sys.getswitchinterval()
            sys.setswitchinterval(0.0002)  # a thread waiting for the interpreter gets it within 0.2 ms
            try:
                return recorded(e, *a)
            finally:
                sys.setswitchinterval(old)

        def no_drain_wait(e, *a):  # noqa: ANN001, ANN202
            # Timing only: the drain neither waits for the device nor writes (the ring's room is
            # released before the device has filled it: the record is not kept).
            drain_on[0] = drain_waits[0] = False
            try:
                return recorded(e, *a)
            finally:
                drain_on[0] = drain_waits[0] = True

        def gc_off(e, *a):  # noqa: ANN001, ANN202
            import gc

            gc.disable()
            try:
                return recorded(e, *a)
            finally:
                gc.enable()

        event_cls = torch.cuda.Event if cuda else None

        def blocking_events(e, *a):  # noqa: ANN001, ANN202
            torch.cuda.Event = lambda *x, **k: event_cls(*x, **{**k, "blocking": True})  # the drain sleeps in its waits
            try:
                return recorded(e, *a)
            finally:
                torch.cuda.Event = event_cls

        variants = {"recorded": recorded, "recorded, drain writes nothing": no_drain, "recorded, no margin/logits ring": no_margin,
                    "recorded, switch interval 0.2 ms": short_switch}
        if args.more:
            variants.update({"recorded, drain neither waits nor writes": no_drain_wait, "recorded, gc off": gc_off})
            if cuda:
                variants["recorded, blocking events"] = blocking_events
        run(plain, 5)
        for fn in variants.values():
            run(fn, 5)
        t_plain: list[float] = []
        t_var: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.blocks):
            t_plain += run(plain, args.block_steps)
            for k, fn in variants.items():
                t_var[k] += run(fn, args.block_steps)
        mp = statistics.median(t_plain)
        print(f"{args.preset} graphs={'on' if cfg['cudagraph'] else 'off'} plain {mp * 1e3:.3f} ms")
        for k, ts in t_var.items():
            m = statistics.median(ts)
            print(f"  {k:34s} {m * 1e3:.3f} ms  {100 * (m - mp) / mp:+.1f}%  {1e6 * (m - mp):+.0f} us")
        if not cuda or args.no_profile:
            print(f"recorder error: {rec.error}")
            session.shutdown()
            session.disabled = True
            return 0
        from torch.profiler import ProfilerActivity, profile

        for title, fn in (("plain", plain), ("recorded", recorded)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(fn, 20)
            print(f"\n== {title}: 20 steps, by device time ==")
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60)
            print(table)
        print(f"recorder error: {rec.error}")
        session.shutdown()
        session.disabled = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
