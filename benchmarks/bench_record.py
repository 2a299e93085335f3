"""Recorder overhead and writer throughput, each measured side by side in one run.

Overhead: the reference MTP engine decodes in one process; blocks of steps alternate between
the plain step (the original, unwrapped ``Engine.decode_step``) and the recorded one (wrapped by
the same instrumentation ``replay record`` injects, default settings), so both see the same
machine state. Reported: median step time of each and the overhead in percent.

Writer throughput: the same bytes written (a) by the recorder recording full logits every step
(digests, copies, writer thread, journal), (b) by the recorder's journal writer alone, and (c) raw
with ``numpy.tofile``, in alternating rounds to one directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def overhead(device: str, preset: str, cudagraph: bool, blocks: int, block_steps: int, durability: str) -> dict:
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine

    cfg = {"preset": preset, "cudagraph": cudagraph, "device": device, "batch": 8 if preset == "small" else 4}
    from replay.workloads.mtp.graphs import GraphRunner

    engine = build_engine(cfg, rank=0, world_size=1, device=device, options={})
    engine.prefill()
    if cudagraph:
        engine.capture_graphs()
    plain = Engine.decode_step
    # The instrumentation patches classes for the life of a process; put them back afterwards so
    # the next configuration starts from the plain engine again.
    saved = [(cls, name, cls.__dict__[name]) for cls, names in ((Engine, ("decode_step", "accept")), (GraphRunner, ("capture", "replay")))
             for name in names]
    with tempfile.TemporaryDirectory() as tmp:
        session = Session(Path(tmp), RecordSettings(durability=durability))
        session.install()  # patches Engine.decode_step (the mtp profile) like `replay record` does
        recorded = Engine.decode_step
        assert recorded is not plain, "the profile did not patch the engine"

        def run(step_fn, n: int) -> list[float]:
            times = []
            for _ in range(n):
                inputs = engine.step_inputs()
                _sync(device)
                t0 = time.perf_counter()
                out = step_fn(engine, *inputs)
                out.accepted.tolist()  # the host needs the accepted counts: the step's natural sync
                times.append(time.perf_counter() - t0)
                engine.advance(out)
            return times

        run(plain, 5)
        run(recorded, 5)
        t_plain: list[float] = []
        t_rec: list[float] = []
        for _ in range(blocks):
            t_plain += run(plain, block_steps)
            t_rec += run(recorded, block_steps)
        rec_error = session.recorder.error if session.recorder is not None else None
        session.shutdown()
        session.disabled = True
    for cls, name, value in saved:
        setattr(cls, name, value)
    mp, mr = statistics.median(t_plain), statistics.median(t_rec)
    return {
        "device": device,
        "preset": preset,
        "cudagraph": cudagraph,
        "durability": durability,
        "steps_each": len(t_plain),
        "plain_ms": round(mp * 1e3, 4),
        "recorded_ms": round(mr * 1e3, 4),
        "overhead_pct": round(100 * (mr - mp) / mp, 2),
        "recorder_error": rec_error,
    }


def writer_throughput(device: str, mb_per_step: int, steps: int, rounds: int) -> dict:
    from replay.format.journal import FrameKind, JournalWriter
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    numel = mb_per_step * (1 << 20) // 4
    logits = [torch.randn(numel, device=device).reshape(-1, 1000) if numel % 1000 == 0 else torch.randn(numel, device=device) for _ in range(2)]
    total = steps * numel * 4
    res: dict[str, list[float]] = {"recorder": [], "journal": [], "tofile": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("REPLAY_BENCH_DIR")) as tmp:
        for r in range(rounds):
            d = Path(tmp) / f"r{r}"
            d.mkdir()
            # (a) the recorder, full logits every step
            rec = Recorder(RecorderConfig(out=d / "rec", outputs="full", rng=False, durability="async", queue_depth=8))
            _sync(device)
            t0 = time.perf_counter()
            for s in range(steps):
                rec.begin_step()
                rec.record_outputs(logits=logits[s % 2])
                rec.end_step()
            rec.close()
            res["recorder"].append(total / (time.perf_counter() - t0))
            assert rec.error is None, rec.error
            # (b) the journal writer alone (what the writer thread does, digests already known)
            host = [x.cpu().numpy() for x in logits]
            jw = JournalWriter(d / "j.journal", d / "j.payload")
            t0 = time.perf_counter()
            for s in range(steps):
                off = jw.write_payload(memoryview(host[s % 2]).cast("B"))
                jw.write_frame(FrameKind.STEP, {"step": s, "outputs": [{"name": "logits", "off": off}]})
            jw.close()
            res["journal"].append(total / (time.perf_counter() - t0))
            # (c) raw numpy.tofile of the same bytes
            t0 = time.perf_counter()
            with open(d / "raw.bin", "wb") as fh:
                for s in range(steps):
                    host[s % 2].tofile(fh)
            res["tofile"].append(total / (time.perf_counter() - t0))
            for f in d.rglob("*"):
                if f.is_file():
                    f.unlink()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "device": device,
        "bytes_per_step": numel * 4,
        "steps": steps,
        "recorder_gbs": round(med["recorder"] / 1e9, 3),
        "journal_gbs": round(med["journal"] / 1e9, 3),
        "tofile_gbs": round(med["tofile"] / 1e9, 3),
        "recorder_vs_raw_pct": round(100 * med["recorder"] / med["tofile"], 1),
        "journal_vs_raw_pct": round(100 * med["journal"] / med["tofile"], 1),
    }


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="tiny (CPU default) or small (GPU default)")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--mb", type=int, default=16, help="MB of logits per step for the writer test")
    ap.add_argument("--writer-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    preset = args.preset or ("small" if args.device.startswith("cuda") else "tiny")
    rows = []
    graph_modes = [True, False] if args.device.startswith("cuda") else [True]
    for cg in graph_modes:
        for dur in ("step", "async"):
            rows.append(overhead(args.device, preset, cg, args.blocks, args.block_steps, dur))
    w = writer_throughput(args.device, args.mb, args.writer_steps, args.rounds)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "torch": torch.__version__,
           "overhead": rows, "writer": w, "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['date']} · {out['machine']} · torch {out['torch']} · `{out['command']}`\n")
    print("| device | preset | graphs | durability | plain step | recorded step | overhead |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['preset']} | {'on' if r['cudagraph'] else 'off'} | {r['durability']} | "
              f"{r['plain_ms']:.3f} ms | {r['recorded_ms']:.3f} ms | {r['overhead_pct']:+.1f}% |")
    print()
    print("| writer path | GB/s | vs numpy.tofile |")
    print("|---|---|---|")
    print(f"| recorder, full logits every step ({w['bytes_per_step'] >> 20} MiB/step, {w['device']} tensors) | {w['recorder_gbs']} | {w['recorder_vs_raw_pct']}% |")
    print(f"| journal writer alone (payload + frame) | {w['journal_gbs']} | {w['journal_vs_raw_pct']}% |")
    print(f"| numpy.tofile, same bytes | {w['tofile_gbs']} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
