"""What each part of the recorder costs a recorded step, measured by leaving it out (a
development tool).

The reference engine decodes in one process; blocks of steps alternate (in an order shuffled
every round) between the plain step, the recorded step, and the recorded step with one part of the
recorder made a no-op for the block: the difference from the recorded step is what that part
costs the step, its effect on the program's own work (caches, allocator) included, which timing
the part's own functions does not show. The variants leave records incomplete: the recording is
thrown away.

    python3 benchmarks/diag/ablate.py --device cpu --preset tiny
    python3 benchmarks/diag/ablate.py --device cuda --preset small          # eager CUDA
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _noop(*_a: Any, **_k: Any) -> None:
    return None


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--block-steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from replay import numerics
    from replay.record import recorder as recorder_mod
    from replay.record.recorder import Recorder
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = {"preset": args.preset, "cudagraph": args.graphs, "device": args.device, "batch": 8, "buckets": [8]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    if args.graphs:
        engine.capture_graphs()
    plain = Engine.decode_step
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp) / "rec", RecordSettings())
        session.install()
        recorded = Engine.decode_step
        cached = numerics.current()

        def off(*patches: tuple[Any, str, Any]) -> Callable:
            def step(eng: Any, *inputs: Any) -> Any:
                with contextlib.ExitStack() as stack:
                    for owner, name, value in patches:
                        stack.enter_context(_patched(owner, name, value))
                    return recorded(eng, *inputs)
            return step

        drain: Any = None

        def drain_stopped(eng: Any, *inputs: Any) -> Any:
            # The drain process stopped for the step (continued after it, and given time to catch
            # up outside the timing, so that its catching up is not charged to the next block).
            os.kill(drain.pid, signal.SIGSTOP)
            try:
                return recorded(eng, *inputs)
            finally:
                os.kill(drain.pid, signal.SIGCONT)

        variants: dict[str, Callable] = {
            "recorded": recorded,
            "- probes": off((Recorder, "record_probe", _noop)),
            "- logits": off((Recorder, "record_logits", _noop)),
            "- outputs": off((Recorder, "record_outputs", _noop)),
            "- inputs": off((Recorder, "record_inputs", _noop)),
            "- numerics": off((numerics, "current", lambda: cached)),
            "- rng": off((recorder_mod._rng, "capture_rng", lambda **_k: {})),
        }
        variants["- drain"] = drain_stopped

        def run(fn: Callable, n: int) -> list[float]:
            times = []
            for i in range(n + 1):
                inputs = engine.step_inputs()
                sync()
                t0 = time.perf_counter()
                out = fn(engine, *inputs)
                out.accepted.tolist()
                t1 = time.perf_counter()
                engine.advance(out)
                if i:
                    times.append(t1 - t0)
            return times

        run(plain, 5)
        run(recorded, 5)
        rec = session.recorder  # made by the first recorded step
        drain = getattr(getattr(rec, "_writer", None), "_proc", None)
        if drain is None:
            del variants["- drain"]
        for fn in variants.values():
            run(fn, 5)
        order = [("plain", plain), *variants.items()]
        blocks: dict[str, list[float]] = {k: [] for k, _ in order}
        shuffle = random.Random(0).shuffle
        for _ in range(args.blocks):
            shuffle(order)
            for k, fn in order:
                blocks[k].append(statistics.median(run(fn, args.block_steps)))
                if k == "- drain":
                    time.sleep(0.05)
        err = rec.error if rec is not None else None
        session.shutdown()
        session.disabled = True
    p = blocks["plain"]
    print(f"torch threads {torch.get_num_threads()}; drain process: {drain is not None}")
    print(f"{args.device} {args.preset} graphs={'on' if args.graphs else 'off'}: plain step {statistics.median(p) * 1e3:.3f} ms; "
          f"{args.blocks} rounds of {args.block_steps} steps; recorder error: {err}")
    print(f"  {'variant':12s} {'over plain':>11s} {'(µs)':>8s} {'part costs':>11s}")
    rec_d = statistics.median(1e6 * (r - q) for q, r in zip(p, blocks["recorded"]))
    for k in variants:
        d = statistics.median(1e6 * (r - q) for q, r in zip(p, blocks[k]))
        pct = statistics.median(100 * (r - q) / q for q, r in zip(p, blocks[k]))
        part = "" if k == "recorded" else f"{rec_d - d:+9.0f} µs"
        print(f"  {k:12s} {pct:+10.1f}% {d:+8.0f} {part:>11s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
