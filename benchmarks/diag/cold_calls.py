"""What single recorder calls cost right after a decode step, against the same call repeated
(a development tool): the host work of a recorded step runs when the step has pushed the
recorder's code and data out of the CPU's caches.

    python3 benchmarks/diag/cold_calls.py [--device cpu|cuda] [--rounds 150]

Each round runs one plain step of the reference engine (``tiny`` on the CPU, ``small`` eager on
CUDA) before each call, timed alone ("cold"), then the same call again at once ("warm").
Medians in µs. Pairs show a way of doing a thing and the one the recorder uses now.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch


def _calls() -> dict[str, Callable[[], Any]]:
    from replay import numerics
    from replay.format.ring_salvage import margin_of
    from replay.record.calls import Binder
    from replay.record.job_meta import _META_JSON

    def step(self, input_ids, input_pos, seq_lens, page_table, slot_ids):  # noqa: ANN001, ANN202 - a step's signature
        return None

    sig = inspect.signature(step)
    binder = Binder(sig)
    args = (object(), *range(5))
    meta = {"b": {"step": 4, "t0": 1796225066.2398899, "t1": 1796225066.248063, "status": "ok",
                  "run": {"mode": "eager", "key": "eager4", "padded": 4, "reason": "cudagraph off"}, "accepted": 6,
                  "args": {"__numerics__": "71982dd142324748"}},
            "g": {"inputs": [[f"input{i}", 0, "int64", [4, 64], True, 4532736 + 2048 * i, 2048, None, -1] for i in range(5)],
                  "tokens": [[f"tokens{i}", 2, "int64", [4, 4], True, 4600640 + 128 * i, 128, None, -1] for i in range(4)],
                  "outputs": [["logits", 1, "float32", [4, 4, 512], False, 4567872, 32768, None, -1]]},
            "f": {"margin": [4535104, "float32", [4, 4, 512]]}}
    logits = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    small = torch.arange(4)

    def partition_margin() -> float:
        part = np.partition(logits, -2, axis=-1)
        return float((part[:, -1] - part[:, -2]).min())

    return {
        "numerics: each setting through its own safe getter": lambda: [s.get() for s in numerics.SETTINGS],
        "numerics.current() (one pass of C readers)": numerics.current,
        "inspect.Signature.bind": lambda: sig.bind(*args),
        "calls.Binder.bind": lambda: binder.bind(*args),
        "json.dumps(meta, separators=..., allow_nan=True)": lambda: json.dumps(meta, separators=(",", ":"), allow_nan=True),
        "job_meta._META_JSON.encode(meta)": lambda: _META_JSON.encode(meta),
        "np.partition margin, 4 MiB": partition_margin,
        "ring_salvage.margin_of, 4 MiB": lambda: margin_of(logits),
        "torch.Tensor.numpy() of 4 int64": small.numpy,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args()
    from replay.workloads.mtp.factory import build_engine

    cuda = args.device.startswith("cuda")
    preset, batch = ("small", 8) if cuda else ("tiny", 4)
    cfg = {"preset": preset, "cudagraph": False, "device": args.device, "batch": batch, "buckets": [batch]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = _calls()
    cold: dict[str, list[float]] = {k: [] for k in calls}
    warm: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            out = engine.decode_step(*engine.step_inputs())
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            engine.advance(out)
            cold[name].append(t1 - t0)
            warm[name].append(t2 - t1)
    print(f"{preset} {'eager' if cuda else ''} {args.device}, {args.rounds} rounds: median µs right after a step (cold) and again at once (warm)")
    print(f"  {'call':55s} {'cold':>8s} {'warm':>8s}")
    for name in calls:
        print(f"  {name:55s} {statistics.median(cold[name]) * 1e6:8.1f} {statistics.median(warm[name]) * 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
