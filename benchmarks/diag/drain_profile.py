"""Where the drain process's CPU time goes (a development tool).

Records ``--steps`` CPU decode steps of the ``mtp`` engine with the drain process running under
``cProfile`` (its command line is changed in this process only), then prints the drain's
functions by their own time. The drain's CPU is taken from the program's cores on a host whose
cores the program's intra-op threads fill.

    python3 benchmarks/diag/drain_profile.py --steps 420
"""

from __future__ import annotations

import argparse
import pstats
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import replay.record.drain as drain_mod
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    with tempfile.TemporaryDirectory() as tmp:
        prof = str(Path(tmp) / "drain.prof")
        drain_mod._CHILD = drain_mod._CHILD.replace(
            "rc = child_main(sys.argv[1:])",
            f"import cProfile; p = cProfile.Profile(); p.enable(); rc = child_main(sys.argv[1:]); p.disable(); p.dump_stats({prof!r})")
        cfg = {"preset": args.preset, "cudagraph": False, "device": "cpu", "batch": 4, "buckets": [4]}
        engine = build_engine(cfg, rank=0, world_size=1, device="cpu", options={})
        engine.prefill()
        session = Session(Path(tmp) / "rec", RecordSettings(drain="process"))
        session.install()
        try:
            for _ in range(args.steps):
                out = Engine.decode_step(engine, *engine.step_inputs())
                out.accepted.tolist()
                engine.advance(out)
        finally:
            session.shutdown()
            session.disabled = True
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
