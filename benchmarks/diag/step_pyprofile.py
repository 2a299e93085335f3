"""Where the recorder's host Python goes in a recorded decode step (a development tool).

Runs recorded steps of the ``mtp`` engine under ``cProfile`` and prints the recorder's own
functions (``replay/``) by total time per step, and the heaviest calls into torch they make.

    python3 benchmarks/diag/step_pyprofile.py                   # eager CUDA, small preset
    python3 benchmarks/diag/step_pyprofile.py --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

import torch


def _ours(file: str) -> bool:
    return "/replay/" in file and "/workloads/" not in file


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    cfg = {"preset": args.preset, "cudagraph": args.graphs, "device": args.device, "batch": 8, "buckets": [8]}
    engine = build_engine(cfg, rank=0, world_size=1, device=args.device, options={})
    engine.prefill()
    if args.graphs:
        engine.capture_graphs()

    def run(fn, n: int) -> None:  # noqa: ANN001
        for _ in range(n):
            inputs = engine.step_inputs()
            out = fn(engine, *inputs)
            out.accepted.tolist()
            engine.advance(out)

    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings())
        session.install()
        recorded = Engine.decode_step
        run(recorded, 20)
        prof = cProfile.Profile()
        prof.enable()
        run(recorded, args.steps)
        prof.disable()
        st = pstats.Stats(prof)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
            if "/workloads/" in file:
                continue  # the program's own code, called by the recorder's wrappers
            mine = _ours(file)
            if mine:
                rows.append((tt, ct, nc, f"{Path(file).parent.name}/{Path(file).name}:{line}", fn, True))
                continue
            # Another module's function: only the share of it that replay's own code called.
            ours = [v for c, v in callers.items() if _ours(c[0])]
            if ours:
                rows.append((sum(v[2] for v in ours), sum(v[3] for v in ours), sum(v[1] for v in ours), file, fn, False))
        n = args.steps
        print(f"{args.device} {args.preset} graphs={'on' if args.graphs else 'off'} steps={n}: µs per step")
        print(f"  {'own':>8s} {'cumul':>8s} {'calls':>6s}  function")
        for tt, ct, nc, where, fn, mine in sorted(rows, key=lambda r: -r[0])[: args.top]:
            print(f"  {tt / n * 1e6:8.1f} {ct / n * 1e6:8.1f} {nc / n:6.1f}  {fn} ({where})" + ("" if mine else "  [called by replay]"))
        mine_total = sum(r[0] for r in rows) / n * 1e6
        print(f"  total own time of replay's functions and the calls they make: {mine_total:.1f} µs per step (under cProfile)")
        session.shutdown()
        session.disabled = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
