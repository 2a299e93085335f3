"""The journal writer's payload rate with and without reserving a write's blocks first, beside
``numpy.tofile`` of the same bytes (a development tool; ``replay.format.prealloc``).

    python3 benchmarks/diag/journal_write.py [--mb 16] [--steps 32] [--rounds 5] [--dir DIR]

Rounds alternate the three writers into one directory; the first round is not counted (the
page cache's first fill). GB/s of each counted round, then the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    from replay.format import prealloc
    from replay.format.journal import FrameKind, JournalWriter

    arrays = [np.random.default_rng(i).standard_normal(args.mb << 18, dtype=np.float32) for i in range(2)]
    total = args.steps * arrays[0].nbytes
    on_min = prealloc.MIN_BYTES
    res: dict[str, list[float]] = {"numpy.tofile": [], "journal, blocks reserved (now)": [], "journal, plain writes": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)

        def journal(reserve: bool) -> float:
            prealloc.MIN_BYTES = on_min if reserve else 1 << 62
            jw = JournalWriter(d / "j.journal", d / "j.payload")
            t0 = time.perf_counter()
            for s in range(args.steps):
                off = jw.write_payloads([memoryview(arrays[s % 2]).cast("B")])
                jw.write_frame(FrameKind.STEP, {"step": s, "off": off})
            jw.close()
            dt = time.perf_counter() - t0
            for f in d.iterdir():
                f.unlink()
            return total / dt / 1e9

        def tofile() -> float:
            t0 = time.perf_counter()
            with open(d / "raw.bin", "wb") as fh:
                for s in range(args.steps):
                    arrays[s % 2].tofile(fh)
            dt = time.perf_counter() - t0
            os.unlink(d / "raw.bin")
            return total / dt / 1e9

        try:
            for r in range(args.rounds + 1):
                got = {"numpy.tofile": tofile(), "journal, blocks reserved (now)": journal(True), "journal, plain writes": journal(False)}
                if r:
                    for k, v in got.items():
                        res[k].append(v)
        finally:
            prealloc.MIN_BYTES = on_min
    print(f"{args.steps} x {args.mb} MiB, {args.rounds} rounds counted, GB/s")
    for k, v in res.items():
        print(f"  {k:32s} median {statistics.median(v):5.2f}   rounds {' '.join(f'{x:.2f}' for x in v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
