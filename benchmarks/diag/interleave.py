"""Plain and recorded decode steps interleaved one by one (a development tool).

``bench_record.py`` alternates blocks of 25 steps; on a shared host a host-bound (eager or CPU)
step drifts between such blocks by more than the recorder costs. Here the blocks are short (4
steps), each recorded step is paired with a plain step a few steps before it, and each is split into the program's own call (its body, timed
the same way in both) and the rest, so that a slower program body can be told from the
recorder's own work:

    python3 benchmarks/diag/interleave.py --no-graphs          # eager CUDA, small preset
    python3 benchmarks/diag/interleave.py --device cpu         # CPU, tiny preset
    python3 benchmarks/diag/interleave.py --writer             # where the full-logits writer waits
    python3 benchmarks/diag/interleave.py --drain thread       # the drain as a thread of the program

The first step after a switch between plain and recorded is not counted (the drain may still be
writing the last recorded step then: that work would be charged to the plain step); ``--pairs``
pairs are counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch


def _variants(session: Any, recorded: Callable) -> dict[str, tuple[Callable, Callable, Callable]]:
    """name -> (step function, switch on, switch off)."""
    from replay.record import writer as writer_mod

    orig_write = writer_mod.Writer._write
    noop = lambda: None  # noqa: E731

    def drain(on: bool, wait: bool) -> Callable:
        def set_() -> None:
            if on:
                writer_mod.Writer._write = orig_write
            else:
                def write(self: Any, job: Any) -> None:
                    if wait and job.event is not None:
                        job.event.synchronize()
                writer_mod.Writer._write = write
        return set_

    def attr(owner: Any, name: str, value: Any) -> tuple[Callable, Callable]:
        old = getattr(owner, name)
        return (lambda: setattr(owner, name, value)), (lambda: setattr(owner, name, old))

    rec = session.recorder
    out = {"recorded": (recorded, noop, noop)}
    if session.settings.drain == "thread" or rec is None or not rec.ring_stats()["enabled"]:
        out["recorded, drain writes nothing"] = (recorded, drain(False, True), drain(True, True))
        out["recorded, drain neither waits nor writes"] = (recorded, drain(False, False), drain(True, True))
    if rec is not None:
        on, off = attr(rec._staging, "defer", False)
        out["recorded, record work on the program's stream"] = (recorded, on, off)
        on, off = attr(rec._staging, "area", False)
        out["recorded, small tensors packed a call (no area)"] = (recorded, on, off)
        on, off = attr(rec._staging, "driver_commit", True)
        out["recorded, commit by the driver's stream write"] = (recorded, on, off)
    on, off = attr(session, "early_path", False)
    out["recorded, no early path"] = (recorded, on, off)
    proc = getattr(getattr(rec, "_writer", None), "_proc", None)
    if proc is not None:
        # The drain process stopped while each block of recorded steps runs (the ring holds
        # them), and let go during the plain block after it so that the ring never fills: what
        # a drain running beside the program costs the program.
        import signal

        stop = lambda: proc.send_signal(signal.SIGSTOP)  # noqa: E731
        go = lambda: proc.send_signal(signal.SIGCONT)  # noqa: E731
        step = _around_each_call(recorded, stop, go)
        out["recorded, drain process stopped"] = (step, noop, step.resume)
        if hasattr(os, "setpriority"):
            # The drain at a lower priority than the program (last: lowering it back may need
            # privileges this process lacks).
            nice = lambda n: (lambda: _set_nice(proc.pid, n))  # noqa: E731
            out["recorded, drain process at nice 10"] = (recorded, nice(10), nice(0))
    return out


def _stopped(session: Any) -> str | None:
    """Why the session records no more (None: it still records)."""
    rec = session.recorder
    return "no recorder" if rec is None else rec.error


def _set_nice(pid: int, value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, value)
    except OSError as e:
        print(f"  (drain process priority {value} not set: {e})")


def _around_each_call(fn: Callable, before: Callable, after: Callable) -> Callable:
    """``fn`` with ``before`` called ahead of the first call of each block (a signal, once:
    not timed into every step); ``resume`` calls ``after``, before the plain block."""
    stopped = [False]

    def step(*a: Any, **k: Any) -> Any:
        if not stopped[0]:
            before()
            stopped[0] = True
        return fn(*a, **k)

    def resume() -> None:
        if stopped[0]:
            after()
            stopped[0] = False

    step.resume = resume  # type: ignore[attr-defined]
    return step


def interleaved(args: argparse.Namespace) -> None:
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    preset = args.preset or ("small" if cuda else "tiny")
    batch = 8 if cuda else 4
    cfg = {"preset": preset, "cudagraph": not args.no_graphs, "device": args.device, "batch": batch, "buckets": [batch]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    if cfg["cudagraph"]:
        engine.capture_graphs()
    plain = Engine.decode_step
    body: list[float] = []

    def timed_body(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plain(*a, **k)
        finally:
            body.append(time.perf_counter() - t0)

    timed_body.__wrapped__ = plain  # type: ignore[attr-defined]
    Engine.decode_step = timed_body
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings(drain=args.drain))
        session.install()
        recorded = Engine.decode_step

        def one(fn: Callable) -> tuple[float, float, float]:
            inputs = engine.step_inputs()
            sync()
            body.clear()
            t0 = time.perf_counter()
            out = fn(engine, *inputs)
            t1 = time.perf_counter()
            out.accepted.tolist()
            t2 = time.perf_counter()
            engine.advance(out)
            return t2 - t0, t1 - t0, body[0] if body else float("nan")

        for _ in range(10):
            one(timed_body)
            one(recorded)
        print(f"{preset} graphs={'on' if cfg['cudagraph'] else 'off'} device={args.device} pairs={args.pairs} drain={args.drain}")
        print(f"  {'variant':42s} {'plain':>9s} {'recorded':>9s} {'diff':>8s} {'pct':>7s}  "
              f"{'body p':>8s} {'body r':>8s} {'bodyΔ':>7s}  {'host p':>8s} {'host r':>8s}")
        for name, (fn, on, off) in _variants(session, recorded).items():
            if args.only and name not in args.only:
                continue
            if _stopped(session):
                # Recording stopped (a full ring held the program up past its limit): the
                # steps left would be timed unrecorded, so no further row compares anything.
                print(f"  {name:42s} not measured: recording stopped ({_stopped(session)})")
                continue
            on()
            try:
                rows = []
                for _ in range(args.pairs // args.block):
                    # The first step of a block is not counted: the drain may still be writing
                    # the other block's last step.
                    if hasattr(fn, "resume"):
                        fn.resume()  # a drain stopped for the last recorded block goes on
                    p = [one(timed_body) for _ in range(args.block + 1)][1:]
                    r = [one(fn) for _ in range(args.block + 1)][1:]
                    rows.extend(zip(p, r))
            finally:
                off()
            med = lambda f: statistics.median(f(p, r) for p, r in rows) * 1e6  # noqa: E731
            wp, wr = med(lambda p, r: p[0]), med(lambda p, r: r[0])
            d = med(lambda p, r: r[0] - p[0])
            bp, br = med(lambda p, r: p[2]), med(lambda p, r: r[2])
            db = med(lambda p, r: r[2] - p[2])
            hp, hr = med(lambda p, r: p[1]), med(lambda p, r: r[1])
            if _stopped(session):
                print(f"  {name:42s} not measured: recording stopped during these steps ({_stopped(session)})")
                continue
            print(f"  {name:42s} {wp:8.0f}µ {wr:8.0f}µ {d:+7.0f}µ {100 * d / wp:+6.1f}%  {bp:7.0f}µ {br:7.0f}µ {db:+6.0f}µ  {hp:7.0f}µ {hr:7.0f}µ",
                  flush=True)
        rec = session.recorder
        print(f"recorder error: {rec.error if rec is not None else None}")
        session.shutdown()
        session.disabled = True
    Engine.decode_step = plain


def writer(args: argparse.Namespace) -> None:
    """The bench's full-logits writer row, with the drain's and the host's waits timed (a drain
    process's own times: ``REPLAY_DRAIN_STATS``, one JSON line per recorder)."""
    import os

    stats = Path(tempfile.mkdtemp()) / "drain-stats.jsonl"
    os.environ["REPLAY_DRAIN_STATS"] = str(stats)
    from replay.format import journal as journal_mod
    from replay.record import ring as ring_mod
    from replay.record import writer as writer_mod
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    acc: dict[str, list[float]] = defaultdict(list)

    def timed(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[label].append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)

    timed(writer_mod.Writer, "_write", "drain: one job (all)")
    timed(writer_mod.Writer, "_digest_entries", "drain: digests")
    timed(journal_mod.JournalWriter, "write_payloads", "drain: payload writev")
    timed(ring_mod.ShmRing, "_wait_room", "host: waits for ring room")
    timed(Recorder, "end_step", "host: end_step")
    timed(Recorder, "record_outputs", "host: record_outputs")
    ev = torch.cuda.Event
    waits: list[float] = []
    orig_sync = ev.synchronize

    def synchronize(self: Any) -> None:
        t0 = time.perf_counter()
        orig_sync(self)
        waits.append(time.perf_counter() - t0)

    ev.synchronize = synchronize  # type: ignore[method-assign]
    numel = args.mb * (1 << 20) // 4
    logits = [torch.randn(numel, device=args.device).reshape(-1, 1024) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(3):
            acc.clear()
            waits.clear()
            rec = Recorder(RecorderConfig(out=Path(tmp) / f"rec{r}", outputs="full", rng=False, ring=0, drain=args.drain))
            for s in range(2):  # as bench_record.py: timed once the drain runs
                rec.begin_step()
                rec.record_outputs(logits=logits[s % 2])
                rec.end_step()
            rec.drain()
            acc.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s in range(args.steps):
                rec.begin_step()
                rec.record_outputs(logits=logits[s % 2])
                rec.end_step()
            t1 = time.perf_counter()
            rec.close()
            t2 = time.perf_counter()
            gbs = args.steps * numel * 4 / (t2 - t0) / 1e9
            print(f"round {r}: {gbs:.3f} GB/s; steps queued in {t1 - t0:.3f} s, close {t2 - t1:.3f} s; ring {rec.ring_stats()}")
            for k, v in sorted(acc.items()):
                print(f"  {k:28s} n={len(v):3d} total {sum(v):.3f} s  median {statistics.median(v) * 1e3:.3f} ms")
            if waits:
                print(f"  {'drain: event waits':28s} n={len(waits):3d} total {sum(waits):.3f} s  median {statistics.median(waits) * 1e3:.3f} ms")
            if stats.exists():
                print(f"  drain process: {stats.read_text().strip().splitlines()[-1]}")
    ev.synchronize = orig_sync  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--pairs", type=int, default=160)
    ap.add_argument("--block", type=int, default=4, help="steps in a row of each kind (plus one not counted)")
    ap.add_argument("--drain", default="process", choices=["process", "thread"])
    ap.add_argument("--writer", action="store_true")
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--only", action="append", default=[], metavar="VARIANT",
                    help="time only this variant (repeatable; e.g. --only recorded)")
    args = ap.parse_args()
    if args.writer:
        writer(args)
    else:
        interleaved(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
