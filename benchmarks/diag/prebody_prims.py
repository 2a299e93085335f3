"""Host cost of the calls a recorded CUDA step makes before the program's step is queued (a
development tool): each candidate timed warm (the same call again and again) and cold (once
right after a plain eager decode step of the reference engine, which pushes the recorder's code
out of the CPU's caches). Medians in µs.

    python3 benchmarks/diag/prebody_prims.py [--preset small] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time
from typing import Any, Callable

import torch


def _candidates(inputs: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    dsts = [torch.empty_like(t) for t in inputs]
    gen = torch.cuda.default_generators[0]
    cpu_gen = torch.default_generator
    capturing_raw = torch._C._cuda_isCurrentStreamCapturing
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch._foreach_copy_(dsts, inputs)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        torch._foreach_copy_(dsts, inputs)
    flat_dst = torch.empty(sum(t.numel() for t in inputs), dtype=inputs[0].dtype, device=inputs[0].device)
    same = all(t.dtype == inputs[0].dtype for t in inputs)

    def copies() -> None:
        for d, t in zip(dsts, inputs):
            d.copy_(t)

    out: dict[str, Callable[[], Any]] = {
        "torch._foreach_copy_ (5 tensors)": lambda: torch._foreach_copy_(dsts, inputs),
        "5 x Tensor.copy_": copies,
        "graph of the copies: replay()": graph.replay,
        "torch.get_rng_state()": torch.get_rng_state,
        "default_generator.get_state()": cpu_gen.get_state,
        "cuda gen.get_state()": gen.get_state,
        "cuda gen.get_offset() + initial_seed()": lambda: (gen.get_offset(), gen.initial_seed()),
        "struct.pack of seed, offset": lambda: struct.pack("<QQ", gen.initial_seed(), gen.get_offset()),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing()": capturing_raw,
        "torch.cuda.is_initialized()": torch.cuda.is_initialized,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch._C._get_tracing_state()": torch._C._get_tracing_state,
        "time.time()": time.time,
        "[t.data_ptr() for 5 inputs]": lambda: [t.data_ptr() for t in inputs],
        "key: (shape, dtype, get_device()) x5": lambda: tuple((t.shape, t.dtype, t.get_device()) for t in inputs),
    }
    if same:
        out["torch.cat(inputs, out=flat)"] = lambda: torch.cat([t.reshape(-1) for t in inputs], out=flat_dst)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    from replay.workloads.mtp.factory import build_engine

    cfg = {"preset": args.preset, "cudagraph": False, "device": "cuda", "batch": 8, "buckets": [8]}
    engine = build_engine(cfg, rank=0, world_size=1, device="cuda", options={})
    engine.prefill()
    inputs = list(engine.step_inputs())
    print("inputs:", [(tuple(t.shape), str(t.dtype)) for t in inputs])
    cands = _candidates(inputs)
    step = type(engine).decode_step
    cold: dict[str, list[float]] = {k: [] for k in cands}
    warm: dict[str, list[float]] = {k: [] for k in cands}
    for r in range(args.rounds):
        for name, fn in cands.items():
            out = step(engine, *engine.step_inputs())
            out.accepted.tolist()
            engine.advance(out)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            if r >= 5:
                cold[name].append(t1 - t0)
                warm[name].append(t2 - t1)
        if r == 4:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{'call':44s} {'cold':>8s} {'warm':>8s}  (median µs, {args.rounds - 5} rounds)")
    for name in cands:
        print(f"{name:44s} {statistics.median(cold[name]) * 1e6:8.1f} {statistics.median(warm[name]) * 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
