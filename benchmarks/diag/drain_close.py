"""How long a recorder's ``close`` takes, and the part of it spent waiting for the drain to end
(a development tool): a few steps recorded on the CPU, drained, then closed, with each drain.

    python3 benchmarks/diag/drain_close.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def main() -> int:
    import replay.record.drain as drain_mod
    import replay.record.writer as writer_mod
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    stops: list[float] = []

    def timed(cls: Any) -> None:
        orig = cls.stop

        def stop(self: Any, timeout: float) -> bool:
            t0 = time.perf_counter()
            try:
                return orig(self, timeout)
            finally:
                stops.append(time.perf_counter() - t0)

        cls.stop = stop

    timed(drain_mod.DrainProcess)
    timed(writer_mod.Writer)
    for drain in ("process", "thread"):
        closes, waits = [], []
        for _ in range(8):
            with tempfile.TemporaryDirectory() as tmp:
                rec = Recorder(RecorderConfig(out=Path(tmp) / "r", rng=False, drain=drain))
                for _ in range(3):
                    rec.begin_step()
                    rec.record_outputs(logits=torch.randn(4, 64))
                    rec.end_step()
                rec.drain()
                stops.clear()
                t0 = time.perf_counter()
                rec.close()
                closes.append(time.perf_counter() - t0)
                waits.append(sum(stops))
        print(f"drain {drain:7s}: close median {statistics.median(closes) * 1e3:6.1f} ms, "
              f"of which waiting for the drain to end {statistics.median(waits) * 1e3:6.1f} ms (8 recorders)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
