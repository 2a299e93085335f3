"""What the damaged-recording checks cost a reader (a development tool; issue 15's eighteenth session).

Opening a rank file checks every table's checksums (``replay.format.h5.read_rank_file``, also for
``info``'s summary read), and every stored tensor read is checked against its recorded digest
(``RankFile.read_tensor``). This times both against the same reads with the check switched off,
on a synthetic rank file of STEPS x PER tensor rows and a recording with a 64 MiB keyframe.

    python3 benchmarks/diag/read_checks.py              # 10,000 steps x 30 tensors
    python3 benchmarks/diag/read_checks.py --steps 1000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def _best_ms(f: Callable[[], object], n: int = 7) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def _rank_file(steps: int, per: int, out: Path) -> None:
    from replay.format.h5 import TABLES, write_rank_file
    from replay.format.schema import RANK_FILE_KIND
    from replay.format.tables import RankTables

    t = {n: np.zeros(0, dtype=d) for n, d in TABLES.items()}
    t["steps"] = np.zeros(steps, dtype=TABLES["steps"])
    t["steps"]["step"] = np.arange(steps)
    for name in ("fields", "tensors"):
        t[name] = np.zeros(steps * per, dtype=TABLES[name])
        t[name]["step"] = np.repeat(np.arange(steps), per)
    t["tensors"]["offset"] = -1
    t["collectives"] = np.zeros(steps * 4, dtype=TABLES["collectives"])
    t["replays"] = np.zeros(steps, dtype=TABLES["replays"])
    rt = RankTables(attrs={"rank": 0, "world_size": 1, "complete": True, "kind": RANK_FILE_KIND}, strings=["a"] * 100,
                    events=[], payload_size=0, **t)
    write_rank_file(rt, out, "x.payload")


def _tables(steps: int, per: int, tmp: Path) -> None:
    from replay.format import h5
    from replay.format.reader import _SUMMARY_TABLES

    p = tmp / "rank-00000.h5"
    _rank_file(steps, per, p)
    print(f"rank file: {steps} steps x {per} tensors, {p.stat().st_size / 2**20:.1f} MiB")
    print(f"  summary read (info), tables checked   {_best_ms(lambda: h5.read_rank_file(p, tables=_SUMMARY_TABLES)):8.1f} ms")
    real = h5._check_chunks
    h5._check_chunks = lambda ds: None
    try:
        print(f"  summary read, chunk check off         {_best_ms(lambda: h5.read_rank_file(p, tables=_SUMMARY_TABLES)):8.1f} ms")
    finally:
        h5._check_chunks = real
    print(f"  full read (step)                      {_best_ms(lambda: h5.read_rank_file(p)):8.1f} ms")


def _tensors(tmp: Path) -> None:
    from replay import Recorder, RecorderConfig
    from replay.format.reader import Recording

    out = tmp / "kf"
    state = {"kv": torch.randn(16, 1024, 1024)}  # 64 MiB
    rec = Recorder(RecorderConfig(out=out, part="run-000", rank=0, world_size=1, keyframe_every=1000, inputs="full"),
                   state_fn=lambda: state)
    for s in range(3):
        rec.begin_step()
        rec.record_inputs(tokens=torch.tensor([[s]]))
        rec.record_outputs(logits=torch.randn(1, 32000))
        rec.end_step()
    rec.close()

    def timed(check: bool, read: Callable[[object], object], scale: float) -> float:
        ts = []
        for _ in range(5):
            with Recording(out) as r:
                rf = r["run-000"][0]
                rf.full()
                if not check:
                    rf._check_digest = lambda *a: None  # noqa: SLF001 - the check switched off for the comparison
                t0 = time.perf_counter()
                read(rf)
                ts.append(time.perf_counter() - t0)
        return min(ts) * scale

    kf = (timed(True, lambda rf: rf.keyframe(0), 1e3), timed(False, lambda rf: rf.keyframe(0), 1e3))
    print(f"64 MiB keyframe read: with the digest check {kf[0]:.1f} ms, without {kf[1]:.1f} ms")
    inp = (timed(True, lambda rf: rf.step(1).inputs, 1e6), timed(False, lambda rf: rf.step(1).inputs, 1e6))
    print(f"one step's inputs (an 8-byte tensor): with the check {inp[0]:.0f} us, without {inp[1]:.0f} us")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--per", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        _tables(args.steps, args.per, Path(d))
        _tensors(Path(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
