"""How fast `replay info` finds the first divergence: 8 ranks x 100,000 steps by default.

The recording is synthesised straight into rank tables (the same `write_rank_file` the sealer
uses), with realistic per-step fields (5 inputs, a graph, 2 collectives, 2 outputs, 2 token
fields), their collectives' rows (each rank's own inputs, as tensor-parallel shards' are: read and
compared for a drift a collective hides, never a divergence), and one rank departing at a late
step. Timed: opening the recording and finding the first divergence through the library, and the
whole `replay info --json` command in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from replay.format.h5 import write_rank_file
from replay.format.manifest import write_manifest
from replay.format.schema import COLLECTIVE_DTYPE, FIELD_DTYPE, STEP_DTYPE
from replay.format.tables import RankTables
from replay.format import h5 as _h5

FIELDS = ["input.input_ids", "input.input_pos", "input.seq_lens", "input.page_table", "input.slot_ids", "graph",
          "collective.0.all_gather_into_tensor", "collective.1.all_reduce", "output.logits", "output.drafts",
          "tokens.tokens", "tokens.accepted"]


def synth(out: Path, ranks: int, steps: int, diverge_rank: int, diverge_at: int) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**63, size=(steps, len(FIELDS)), dtype=np.uint64)
    out.mkdir(parents=True)
    write_manifest(out, {"command": ["synthetic"], "world_size": ranks})
    part = out / "run-000"
    part.mkdir(parents=True)
    ops = ["all_gather_into_tensor", "all_reduce"]
    strings = list(FIELDS) + ops
    for r in range(ranks):
        d = base.copy()
        if r == diverge_rank:
            d[diverge_at:, FIELDS.index("output.logits"):] += np.uint64(1)
        fields = np.zeros(steps * len(FIELDS), dtype=FIELD_DTYPE)
        fields["step"] = np.repeat(np.arange(steps), len(FIELDS))
        fields["order"] = np.tile(np.arange(len(FIELDS)), steps)
        fields["field"] = np.tile(np.arange(len(FIELDS)), steps)
        fields["digest"] = d.reshape(-1)
        st = np.zeros(steps, dtype=STEP_DTYPE)
        st["step"] = np.arange(steps)
        st["mode"] = 2
        st["graph"] = -1
        st["graph_key"] = -1
        st["reason"] = -1
        st["args"] = -1
        st["margin"] = rng.random(steps).astype(np.float32)
        coll = np.zeros(steps * len(ops), dtype=COLLECTIVE_DTYPE)
        coll["step"] = np.repeat(np.arange(steps), len(ops))
        coll["ordinal"] = np.arange(coll.size)
        coll["op"] = np.tile(np.arange(len(FIELDS), len(FIELDS) + len(ops)), steps)
        coll["in_digest"] = rng.integers(1, 2**63, size=coll.size, dtype=np.uint64)  # a shard's own: differs by rank
        coll["out_digest"] = base[:, [FIELDS.index("collective.0.all_gather_into_tensor"), FIELDS.index("collective.1.all_reduce")]].reshape(-1)
        coll["out_tensor"] = -1
        coll["compare"] = 1
        empty = {name: np.zeros(0, dtype=dt) for name, dt in _h5.TABLES.items() if name not in ("steps", "fields", "collectives")}
        t = RankTables(attrs={"rank": r, "world_size": ranks, "part": "run-000", "complete": True}, strings=strings,
                       steps=st, fields=fields, collectives=coll, **empty)
        (part / f"rank-{r:05d}.payload").touch()
        write_rank_file(t, part / f"rank-{r:05d}.h5", f"rank-{r:05d}.payload")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from replay.analysis.divergence import first_divergence
    from replay.format.reader import Recording

    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "rec"
        t0 = time.perf_counter()
        synth(rec, args.ranks, args.steps, diverge_rank=5, diverge_at=args.steps - 1234)
        t_synth = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in rec.rglob("*") if f.is_file())
        best_lib = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            with Recording(rec) as r:
                d = first_divergence(r["run-000"])
            best_lib = min(best_lib, time.perf_counter() - t0)
        assert d is not None and d.step == args.steps - 1234 and d.ranks == [5] and d.field == "output.logits", d
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "replay", "info", str(rec), "--json"], capture_output=True, text=True)
        t_cli = time.perf_counter() - t0
        assert p.returncode == 0, p.stderr
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import replay.cli.main, replay.analysis.summary"], check=True)
        t_import = time.perf_counter() - t0
        info = json.loads(p.stdout)
    row = {
        "ranks": args.ranks,
        "steps": args.steps,
        "recording_mb": round(size / 1e6, 1),
        "first_divergence_s": round(best_lib, 3),
        "info_command_s": round(t_cli, 3),
        "python_and_imports_s": round(t_import, 3),
        "found": info["first_divergence"],
        "machine": platform.processor() or platform.machine(),
        "synth_s": round(t_synth, 1),
    }
    if args.json:
        print(json.dumps(row))
    else:
        print(f"| ranks x steps | recording | first divergence (library) | `replay info --json` (whole command) | of which python + imports |")
        print("|---|---|---|---|---|")
        print(f"| {args.ranks} x {args.steps:,} | {row['recording_mb']} MB | {row['first_divergence_s']} s | {row['info_command_s']} s | {row['python_and_imports_s']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
