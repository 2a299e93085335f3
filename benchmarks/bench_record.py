"""Recorder overhead and writer throughput, each measured side by side in one run.

Overhead: the reference MTP engine decodes in one process; blocks of steps alternate between the
plain step (the original, unwrapped ``Engine.decode_step``) and each recorded variant, in an order
shuffled every round, so all see the same machine state:

* ``replay`` — wrapped by the same instrumentation ``replay record`` injects, default settings
  (``default: true`` in the JSON);
* ``replay, drain thread`` — the same with the ring drained by a thread of the program instead of
  a process of its own (eager CUDA and CPU, where the program's interpreter is the bottleneck);
* ``replay, no ring`` — the same with the record ring off (the writer-thread path, durability
  ``step``), for comparison with the figures before the ring;
* ``torch.save`` — what a user would otherwise write: the step's input and output tensors saved
  with ``torch.save``, one file a step;
* ``metadata only`` — a recorder that writes each step's id and its tensors' names, dtypes and
  shapes (one JSON line a step, flushed), no digests and no bytes.

Blocks are short (``--block-steps``, 4 counted steps): a host-bound step (eager, CPU) on a shared
host drifts over a block of 25 steps by more than the recorder costs
(``benchmarks/diag/interleave.py``). Before them, the steps of the block's first ``SETTLE_S``
(37.5 ms: one and a half of the drain process's longest sleep, and at least one step) are run and
not counted: the drain may still be writing the block before (its work would be charged to this
one), and by then a recorded block's drain runs at its own pace. The drain process's own CPU time
a recorded step is reported beside (``ring.drain_cpu_us_per_step``; on a host whose cores the
program fills, it is taken from the program).

Reported per configuration: the plain step (the median of its blocks' medians), the overhead
in percent and in microseconds a step (the median over rounds of each round's recorded block
against its plain block: robust to a host whose speed moves during the run; ``recorded step`` is
the plain step plus that overhead), and the spread (the lowest and highest overhead of six runs
of consecutive block pairs). The json keeps ``pooled_overhead_pct``, the medians of all steps
compared, as runs before 2026-12-06 04:30 UTC reported it.

Writer throughput: the same bytes written (a) by the recorder recording full logits every step
(device digests, copies into the ring, the drain, the journal; timed once its drain runs, until
the journal holds every step, and again with its close: the fixed cost of ending a rank's
recording, reported in ms), (b) by the journal writer alone,
and raw with ``numpy.tofile`` (c) of two host arrays rewritten every step, whose bytes stay in the
host's cache, and (d) of each step's own array copied off the GPU beforehand, whose bytes are
not in cache, as a step's logits are not when a recorder writes them; in alternating rounds to
one directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from replay.format.ring_drain import POLL_MAX_S

# The start of each block that is not counted (see ``overhead``).
SETTLE_S = 1.5 * POLL_MAX_S


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _tensors(xs: Any) -> dict[str, torch.Tensor]:
    if hasattr(xs, "_asdict"):
        xs = xs._asdict()
    if isinstance(xs, dict):
        return {k: v for k, v in xs.items() if isinstance(v, torch.Tensor)}
    return {f"arg{i}": v for i, v in enumerate(xs) if isinstance(v, torch.Tensor)}


def _dumper(plain: Callable, out_dir: Path) -> Callable:
    """A per-step ``torch.save`` of the step's inputs and outputs."""
    n = [0]

    def step(engine: Any, *inputs: Any) -> Any:
        out = plain(engine, *inputs)
        torch.save({"inputs": _tensors(inputs), "outputs": _tensors(out)}, out_dir / f"step-{n[0]:06d}.pt")
        n[0] += 1
        return out

    return step


def _metadata(plain: Callable, path: Path) -> Callable:
    """Ids and shapes only: one JSON line a step, flushed (as durable as the page cache)."""
    fh = open(path, "a", buffering=1 << 16)
    n = [0]

    def step(engine: Any, *inputs: Any) -> Any:
        out = plain(engine, *inputs)
        meta = {"step": n[0]}
        for group, ts in (("in", _tensors(inputs)), ("out", _tensors(out))):
            meta[group] = [[k, str(t.dtype), list(t.shape)] for k, t in ts.items()]
        fh.write(json.dumps(meta) + "\n")
        fh.flush()
        n[0] += 1
        return out

    return step


def _ab_variants(session: Any, recorded: Callable) -> dict[str, Callable]:
    """The default recorder with one of its parts switched off, for side-by-side comparison."""
    from replay.record.session import Session

    def toggled(attr: str, owner: str, value: Any = False) -> Callable:
        def step(engine: Any, *inputs: Any) -> Any:
            target = Session if owner == "session" else session.recorder._staging
            old = getattr(target, attr)
            setattr(target, attr, value)
            try:
                return recorded(engine, *inputs)
            finally:
                setattr(target, attr, old)

        return step

    return {
        "replay, bookkeeping before the call (no early path)": toggled("early_path", "session"),
        "replay, side work without a graph": toggled("static_snapshots", "staging"),
        "replay, record work on the program's stream": toggled("defer", "staging"),
        "replay, small tensors packed a call (no step area)": toggled("area", "staging"),
        "replay, commit by the driver's stream write": toggled("driver_commit", "staging", True),
    }


def overhead(device: str, preset: str, cudagraph: bool, blocks: int, block_steps: int, *, batch: int,
             baselines: bool, ring: bool = True, label: str = "", ab: bool = False, drain: str = "process") -> list[dict]:
    from replay.record.session import Session
    from replay.record.settings import RecordSettings
    from replay.workloads.mtp.engine import Engine
    from replay.workloads.mtp.factory import build_engine
    from replay.workloads.mtp.graphs import GraphRunner

    cfg = {"preset": preset, "cudagraph": cudagraph, "device": device, "batch": batch, "buckets": [batch]}
    engine = build_engine(cfg, rank=0, world_size=1, device=device, options={})
    engine.prefill()
    if cudagraph:
        engine.capture_graphs()
    plain = Engine.decode_step
    # The instrumentation patches classes for the life of a process; put them back afterwards so
    # the next configuration starts from the plain engine again.
    saved = [(cls, name, cls.__dict__[name]) for cls, names in ((Engine, ("decode_step", "accept")), (GraphRunner, ("capture", "replay")))
             for name in names]
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("REPLAY_BENCH_DIR")) as tmp:
            session = Session(Path(tmp) / "rec", RecordSettings(drain=drain) if ring else RecordSettings(record_ring_mib=0))
            session.install()  # patches Engine.decode_step (the mtp profile) like `replay record` does
            recorded = Engine.decode_step
            assert recorded is not plain, "the profile did not patch the engine"
            name = "replay" if drain == "process" else "replay, drain thread"
            variants: dict[str, Callable] = {name if ring else "replay, no ring": recorded}
            if ab and ring:
                variants.update(_ab_variants(session, recorded))
            if baselines:
                (Path(tmp) / "save").mkdir()
                variants["torch.save"] = _dumper(plain, Path(tmp) / "save")
                variants["metadata only"] = _metadata(plain, Path(tmp) / "meta.jsonl")

            steps_run: dict[str, int] = {}

            def run(step_fn: Callable, n: int, settle_s: float = 0.0, key: str = "") -> list[float]:
                """``n`` steps timed, after the steps of the block's first ``settle_s`` (and its
                first step), which are run and not counted."""
                times = []
                start = time.perf_counter()
                skipped = 0
                while len(times) < n:
                    inputs = engine.step_inputs()
                    _sync(device)
                    t0 = time.perf_counter()
                    out = step_fn(engine, *inputs)
                    out.accepted.tolist()  # the host needs the accepted counts: the step's natural sync
                    t1 = time.perf_counter()
                    engine.advance(out)
                    steps_run[key] = steps_run.get(key, 0) + 1
                    if skipped < 1 or t0 - start < settle_s:
                        skipped += 1
                        continue
                    times.append(t1 - t0)
                return times

            run(plain, 5)
            for fn in variants.values():
                run(fn, 5)
            t_plain: list[list[float]] = []
            t_var: dict[str, list[list[float]]] = {k: [] for k in variants}
            drain_proc = getattr(getattr(session.recorder, "_writer", None), "_proc", None)
            drain_cpu0 = _cpu_s(drain_proc.pid) if drain_proc is not None else None
            steps_run.clear()
            # A block's first steps are not counted: its first, and those of its first SETTLE_S,
            # the drain process's longest sleep and then some. They may still pay for the block
            # before it (a drain writing that block's records lands in them), and by the end of
            # them a recorded block's drain runs at its own pace. The order of the blocks changes
            # from round to round, so that no variant always follows the same one (torch.save's
            # writeback slowed whatever ran after it).
            order = [("plain", plain), *variants.items()]
            shuffle = random.Random(0).shuffle
            for _ in range(blocks):
                shuffle(order)
                for k, fn in order:
                    (t_plain if k == "plain" else t_var[k]).append(run(fn, block_steps, SETTLE_S, k))
            rec = session.recorder
            rec_error = rec.error if rec is not None else None
            ring_stats = rec.ring_stats() if rec is not None else None
            if drain_cpu0 is not None and ring_stats is not None:
                # The drain's CPU time over the timed rounds, per step that a replay variant ran.
                recorded_steps = sum(n for k, n in steps_run.items() if k.startswith("replay"))
                ring_stats["drain_cpu_us_per_step"] = round(1e6 * (_cpu_s(drain_proc.pid) - drain_cpu0) / max(recorded_steps, 1), 1)
            session.shutdown()
            session.disabled = True
    finally:
        for cls, name, value in saved:
            setattr(cls, name, value)
    rows = []
    for k, blocks_k in t_var.items():
        mp, d_us, pct, pooled = _paired(t_plain, blocks_k)
        pairs = _group_spread(t_plain, blocks_k)
        rows.append({
            "device": device,
            "preset": label or preset,
            "batch": batch,
            "cudagraph": cudagraph,
            "variant": k,
            "default": k == "replay",
            "drain": (drain if ring else None) if k.startswith("replay") else None,
            "steps_each": sum(map(len, blocks_k)),
            "plain_ms": round(mp * 1e3, 4),
            "recorded_ms": round((mp + d_us * 1e-6) * 1e3, 4),
            "overhead_pct": round(pct, 2),
            "overhead_us": round(d_us, 1),
            "spread_pct": [round(min(pairs), 2), round(max(pairs), 2)],
            "pooled_overhead_pct": round(pooled, 2),
            "recorder_error": rec_error if k.startswith("replay") else None,
            "ring": ring_stats if k.startswith("replay") else None,
        })
    return rows


def _paired(t_plain: list[list[float]], t_rec: list[list[float]]) -> tuple[float, float, float, float]:
    """(plain step s, overhead µs, overhead %, pooled overhead %) from blocks run in the same
    rounds. Each round's recorded block is compared with its plain block (the median step of
    each), and the figures are the medians over the rounds: a host whose speed moves during the
    run (a CPU step of 5.3 ms in some rounds and 7.9 ms in others, on a GPU machine's host) moves
    both blocks of a round alike, while the medians of all plain and all recorded steps can land
    on different speeds (+50% where every run of rounds read +9..+14%). The pooled figure is kept
    beside it for comparison with earlier runs."""
    p = [statistics.median(b) for b in t_plain]
    r = [statistics.median(b) for b in t_rec]
    plain = statistics.median(p)
    d_us = statistics.median(1e6 * (rb - pb) for pb, rb in zip(p, r))
    pct = statistics.median(100 * (rb - pb) / pb for pb, rb in zip(p, r))
    mp = statistics.median([t for b in t_plain for t in b])
    mr = statistics.median([t for b in t_rec for t in b])
    return plain, d_us, pct, 100 * (mr - mp) / mp


def _group_spread(t_plain: list[list[float]], t_rec: list[list[float]], groups: int = 6) -> list[float]:
    """The overhead (%) of each of ``groups`` runs of consecutive block pairs: how much the
    figure moves over the run (short blocks alone are too few steps to compare one by one)."""
    n = len(t_plain)
    size = max(1, n // groups)
    out = []
    for i in range(0, n - n % size if n >= size else n, size):
        p = [t for b in t_plain[i : i + size] for t in b]
        r = [t for b in t_rec[i : i + size] for t in b]
        out.append(100 * (statistics.median(r) - statistics.median(p)) / statistics.median(p))
    return out


def writer_throughput(device: str, mb_per_step: int, steps: int, rounds: int) -> dict:
    from replay.format.journal import FrameKind, JournalWriter
    from replay.record.config import RecorderConfig
    from replay.record.recorder import Recorder

    numel = mb_per_step * (1 << 20) // 4
    logits = [torch.randn(numel, device=device).reshape(-1, 1024) if numel % 1024 == 0 else torch.randn(numel, device=device) for _ in range(2)]
    total = steps * numel * 4
    res: dict[str, list[float]] = {"recorder": [], "recorder_journal": [], "journal": [], "tofile": [], "tofile_fresh": []}
    close_s: list[float] = []
    ring_stats = None
    with tempfile.TemporaryDirectory(dir=os.environ.get("REPLAY_BENCH_DIR")) as tmp:
        for r in range(rounds):
            d = Path(tmp) / f"r{r}"
            d.mkdir()
            # (a) the recorder, full logits every step, default ring; timed from its first step
            # once its drain runs (two steps drained before: the drain process's start, some
            # 0.15-0.4 s, is paid once per rank, not per byte)
            rec = Recorder(RecorderConfig(out=d / "rec", outputs="full", rng=False, ring=0))  # no logits ring: the journal path alone
            for s in range(2):
                rec.begin_step()
                rec.record_outputs(logits=logits[s % 2])
                rec.end_step()
            rec.drain()
            _sync(device)
            t0 = time.perf_counter()
            for s in range(steps):
                rec.begin_step()
                rec.record_outputs(logits=logits[s % 2])
                rec.end_step()
            # Every step's bytes in the journal (written, as numpy.tofile's are: no fsync), then
            # the close: the end marker, the drain's end, the ring's teardown and the rank's
            # sealed file, a fixed cost once per rank and recording.
            assert rec.drain(), "the drain did not write every step in time"
            t1 = time.perf_counter()
            res["recorder_journal"].append(total / (t1 - t0))
            rec.close()
            t2 = time.perf_counter()
            res["recorder"].append(total / (t2 - t0))
            close_s.append(t2 - t1)
            ring_stats = rec.ring_stats()
            assert rec.error is None, rec.error
            # (b) the journal writer alone (what the drain does, digests already known)
            host = [x.cpu().numpy() for x in logits]
            jw = JournalWriter(d / "j.journal", d / "j.payload")
            t0 = time.perf_counter()
            for s in range(steps):
                off = jw.write_payload(memoryview(host[s % 2]).cast("B"))
                jw.write_frame(FrameKind.STEP, {"step": s, "outputs": [{"name": "logits", "off": off}]})
            jw.close()
            res["journal"].append(total / (time.perf_counter() - t0))
            # (c) raw numpy.tofile of the same bytes: the two host arrays again and again (their
            # bytes stay in the host's cache), and (d) each step's own array, copied off the GPU
            # before the timing, as a step's logits are when they are written (not in cache).
            t0 = time.perf_counter()
            with open(d / "raw.bin", "wb") as fh:
                for s in range(steps):
                    host[s % 2].tofile(fh)
            res["tofile"].append(total / (time.perf_counter() - t0))
            fresh = [(logits[s % 2] + s).cpu().numpy() for s in range(steps)]
            t0 = time.perf_counter()
            with open(d / "raw2.bin", "wb") as fh:
                for a in fresh:
                    a.tofile(fh)
            res["tofile_fresh"].append(total / (time.perf_counter() - t0))
            del fresh
            for f in d.rglob("*"):
                if f.is_file():
                    f.unlink()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "device": device,
        "bytes_per_step": numel * 4,
        "steps": steps,
        "rounds": rounds,
        "recorder_gbs": round(med["recorder"] / 1e9, 3),
        "recorder_journal_gbs": round(med["recorder_journal"] / 1e9, 3),
        "recorder_journal_vs_raw_pct": round(100 * med["recorder_journal"] / med["tofile"], 1),
        "recorder_journal_vs_fresh_pct": round(100 * med["recorder_journal"] / med["tofile_fresh"], 1),
        "close_ms": round(1e3 * statistics.median(close_s), 1),
        "journal_gbs": round(med["journal"] / 1e9, 3),
        "tofile_gbs": round(med["tofile"] / 1e9, 3),
        "tofile_fresh_gbs": round(med["tofile_fresh"] / 1e9, 3),
        "recorder_vs_raw_pct": round(100 * med["recorder"] / med["tofile"], 1),
        "recorder_vs_fresh_pct": round(100 * med["recorder"] / med["tofile_fresh"], 1),
        "journal_vs_raw_pct": round(100 * med["journal"] / med["tofile"], 1),
        "all_rounds_gbs": {k: [round(x / 1e9, 3) for x in v] for k, v in res.items()},
        "ring": ring_stats,
    }


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc; 0 where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--block-steps", type=int, default=4, help="steps per block, plus one not counted (short blocks: a host-bound step drifts over longer ones)")
    ap.add_argument("--large-batch", type=int, default=128, help="batch of the larger configuration (small preset, graphs)")
    ap.add_argument("--cpu-blocks", type=int, default=40, help="blocks of the CPU tiny rows (noisy: more pairs)")
    ap.add_argument("--eager-blocks", type=int, default=None, help="blocks of the eager CUDA rows (default: --blocks; a host-bound step is noisy on a shared host)")
    ap.add_argument("--no-cpu", action="store_true", help="on a CUDA machine, skip the CPU tiny rows")
    ap.add_argument("--mb", type=int, default=16, help="MB of logits per step for the writer test")
    ap.add_argument("--writer-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab", action="store_true", help="also the default recorder with parts switched off (CUDA rows)")
    ap.add_argument("--only", default=None, help="comma-separated row groups: graphs,eager,large,noring,thread,cpu,writer")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    rows: list[dict] = []
    configs: list[tuple[str, str, bool, int, dict]] = []
    only = set(args.only.split(",")) if args.only else {"graphs", "eager", "large", "noring", "thread", "cpu", "writer"}
    if args.device.startswith("cuda"):
        configs += [
            ("graphs", "cuda", "small", True, 8, {"baselines": True, "ab": args.ab}),
            ("eager", "cuda", "small", False, 8, {"baselines": True, "ab": args.ab, "blocks": args.eager_blocks or args.blocks}),
            ("large", "cuda", "small", True, args.large_batch, {"baselines": False, "label": f"small-b{args.large_batch}"}),
            ("noring", "cuda", "small", True, 8, {"baselines": False, "ring": False}),
            ("thread", "cuda", "small", False, 8, {"baselines": False, "drain": "thread", "blocks": args.eager_blocks or args.blocks}),
        ]
    if not args.device.startswith("cuda") or not args.no_cpu:
        configs.append(("cpu", "cpu", "tiny", True, 4, {"baselines": True, "blocks": args.cpu_blocks}))
        configs.append(("thread", "cpu", "tiny", True, 4, {"baselines": False, "drain": "thread", "blocks": args.cpu_blocks}))
    configs = [c[1:] for c in configs if c[0] in only]
    for dev, preset, cg, batch, kw in configs:
        blocks = kw.pop("blocks", args.blocks)
        t0 = time.perf_counter()
        rows += overhead(dev, preset, cg, blocks, args.block_steps, batch=batch, **kw)
        print(f"# {dev} {preset} b{batch} graphs={cg} {kw}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    w = writer_throughput(args.device, args.mb, args.writer_steps, args.rounds) if "writer" in only else None
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "torch": torch.__version__,
           "cpu_cores": os.cpu_count(), "overhead": rows, "writer": w,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
        return 0
    print(render(out))
    return 0


def _drain_cpu(row: dict) -> str:
    us = (row.get("ring") or {}).get("drain_cpu_us_per_step")
    return "-" if us is None or not row["default"] else f"{us:.0f} µs"


def render(out: dict) -> str:
    lines = [f"{out['date']} · {out['machine']} · torch {out['torch']} · `{out['command']}`", ""]
    lines.append("| device | preset | graphs | recorder | plain step | recorded step | overhead | per step | spread (block pairs) | all steps pooled | drain CPU a step |")
    lines.append("|---|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    for r in out["overhead"]:
        name = r["variant"] + (" (default settings)" if r["default"] else "")
        lines.append(f"| {r['device']} | {r['preset']} | {'on' if r['cudagraph'] else 'off'} | {name} | {r['plain_ms']:.3f} ms | "
                     f"{r['recorded_ms']:.3f} ms | {r['overhead_pct']:+.1f}% | {r['overhead_us']:+.0f} µs | "
                     f"{r['spread_pct'][0]:+.1f}% .. {r['spread_pct'][1]:+.1f}% | {r['pooled_overhead_pct']:+.1f}% | {_drain_cpu(r)} |")
    w = out["writer"]
    if w is None:
        return "\n".join(lines)
    lines += ["", "| writer path | GB/s | vs numpy.tofile |", "|---|---|---|",
              f"| recorder, full logits every step ({w['bytes_per_step'] >> 20} MiB/step, {w['device']} tensors), until the journal holds every step | "
              f"{w.get('recorder_journal_gbs', '-')} | {w.get('recorder_journal_vs_raw_pct', '-')}% |",
              f"| the same, with the recorder's close ({w.get('close_ms', '-')} ms: end marker, drain's end, ring teardown, sealed rank file) | "
              f"{w['recorder_gbs']} | {w['recorder_vs_raw_pct']}% |",
              f"| journal writer alone (payload + frame) | {w['journal_gbs']} | {w['journal_vs_raw_pct']}% |",
              f"| numpy.tofile, same bytes (two arrays rewritten: in the host's cache) | {w['tofile_gbs']} | 100% |",
              f"| numpy.tofile, same bytes (each step's own array, off the GPU: not in cache) | {w.get('tofile_fresh_gbs', '-')} | "
              f"{round(100 * w['tofile_fresh_gbs'] / w['tofile_gbs'], 1) if w.get('tofile_fresh_gbs') else '-'}% |",
              f"| recorder until the journal holds every step, vs the not-in-cache write | | {w.get('recorder_journal_vs_fresh_pct', '-')}% |",
              f"| recorder with its close, vs the not-in-cache write | | {w.get('recorder_vs_fresh_pct', '-')}% |"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
