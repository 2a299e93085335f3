"""What ``Staging.entries`` costs for a step's CPU tensors, warm (repeated) and cold (right after a
1024x1024 matmul has pushed the recorder's code and data out of the caches), as a recorded step
calls it (a development tool):

    python3 benchmarks/diag/cold_entries.py [--n 5000]

Two calls of the reference engine's ``tiny`` step, on CPU tensors of its shapes: its inputs (5
small int64 tensors) and its outputs (logits 4x4x512 float32 and 3 small int64). Medians in µs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    from replay.format.schema import TensorKind
    from replay.record.ring import ShmRing
    from replay.record.staging import Staging

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    args = ap.parse_args()
    ring = ShmRing(tempfile.mkdtemp(dir="/dev/shm"), 64 << 20, rank=0)
    staging = Staging(ring)
    ins = [(n, TensorKind.INPUT, t, True) for n, t in (("input_ids", torch.arange(4)), ("input_pos", torch.arange(4)),
           ("seq_lens", torch.arange(4)), ("page_table", torch.zeros(4, 64, dtype=torch.int64)), ("slot_ids", torch.arange(4)))]
    outs = [("logits", TensorKind.OUTPUT, torch.randn(4, 4, 512), False), ("tokens", TensorKind.TOKENS, torch.zeros(4, 4, dtype=torch.int64), True),
            ("accepted", TensorKind.TOKENS, torch.arange(4), True), ("drafts", TensorKind.OUTPUT, torch.zeros(4, 3, dtype=torch.int64), False)]
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    try:
        for cold in (False, True):
            for name, items in (("inputs", ins), ("outputs", outs)):
                times = []
                for _ in range(args.n if not cold else args.n // 5):
                    ring._tail = ring.head  # as if drained: the ring never fills here
                    if cold:
                        torch.mm(a, b)
                    job = staging.open_job()
                    t0 = time.perf_counter()
                    staging.entries(job, None, items, step=True)
                    times.append(time.perf_counter() - t0)
                print(f"{name:8s} {'cold' if cold else 'warm'}  {statistics.median(times) * 1e6:6.1f} µs")
    finally:
        ring.close(unlink=True)


if __name__ == "__main__":
    main()
