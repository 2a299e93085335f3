#!/usr/bin/env python3
"""Render a recording's HTML report and open it in headless Chromium, saving a screenshot.

    python scripts/report_check.py                      # newest recording under recordings/
    python scripts/report_check.py recordings/RUN       # that recording
    python scripts/report_check.py --demo --docs        # the example in docs/img/ (re-makes it)

Exits non-zero with one line when the page cannot be rendered or Chromium is missing. ``--demo``
builds a synthetic 4-rank recording with the real recorder: per-rank autotuning gives rank 2
other output bits whenever it replays a CUDA graph (eager steps agree), until a near-tie flips
its token; it also writes example ``replay step`` / ``replay bisect`` results beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from replay import Recorder, RecorderConfig

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DOCS_IMG = ROOT / "docs" / "img"
VOCAB = 64


def find_chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    for name in CHROMIUM_NAMES:
        p = shutil.which(name)
        if p:
            return p
    return None


def screenshot(page: Path, png: Path, *, width: int = 1400, height: int = 3000, timeout: float = 120.0) -> None:
    """Open ``page`` in headless Chromium and write a ``width`` x ``height`` screenshot to ``png``."""
    exe = find_chromium()
    if exe is None:
        raise SystemExit("report-check: chromium not found: apt-get install chromium")
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="report-check-") as profile:
        cmd = [
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}",
            f"--window-size={width},{height}", page.resolve().as_uri(),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"report-check: chromium did not finish within {timeout:.0f} s") from None
    if not png.exists() or png.stat().st_size < 5000:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"report-check: chromium wrote no screenshot (exit {proc.returncode}: {last[:200]})")


# -- the demo recording ---------------------------------------------------------------------


def demo_recording(out: Path, *, ranks: int = 4, steps: int = 300, odd_rank: int = 2, flip_at: int = 212) -> Path:
    """A demo-like recording: rank ``odd_rank`` tuned another MoE kernel into its graphs."""
    batch_of = lambda s: 8 if s < 120 else 6 if s < 200 else 3
    bucket_of = lambda b: 8 if b > 4 else 4
    base_kernels = ["rmsnorm_fwd", "flash_decode_bf16", "gemm_bf16_128x128", "moe_router_topk", "MOE_GEMM", "moe_combine", "allgather_ll", "lm_head_gemm"]
    for r in range(ranks):
        rec = Recorder(RecorderConfig(out=out, part="run-000", rank=r, world_size=ranks, keyframe_every=100, rng=False),
                       state_fn=lambda: {"kv": torch.zeros(4, 4)})
        tactic = "moe_gemm_tile128x64_splitk2" if r == odd_rank else "moe_gemm_tile128x128"
        rec.record_tuner({"moe_gemm": tactic, "lm_head_gemm": "cublas_default", "attn_decode": "flash_decode_bf16"})
        gids = {}
        for padded in (4, 8):
            kernels = [{"name": tactic if k == "MOE_GEMM" else k, "grid": [padded, 1, 1], "block": [128, 1, 1]} for k in base_kernels]
            gids[padded] = rec.record_graph(f"decode-bs{padded}", padded_size=padded, kernels=kernels, source="torch.cuda.CUDAGraph")
        odd_stream = torch.Generator().manual_seed(77)
        for s in range(steps):
            g = torch.Generator().manual_seed(5000 + s)
            bs = batch_of(s)
            # Every 50th step prefills a new request: no graph for that shape, so it runs eagerly.
            eager = s % 50 == 25 or (r == 3 and s in (161, 162))
            rec.begin_step()
            diverged = r == odd_rank and s > flip_at
            ids = torch.randint(0, VOCAB, (bs, 1), generator=odd_stream if diverged else g)
            rec.record_inputs(input_ids=ids, input_pos=torch.full((bs,), s, dtype=torch.int32))
            logits = torch.randn(bs, VOCAB, generator=g) * 3
            # Margins: mostly comfortable, a few near-ties, the tightest exactly where the token flips.
            gaps = np.exp(np.random.default_rng(s).normal(-0.5, 1.0, size=bs))
            if s == flip_at:
                gaps[0] = 0.0039
            top = logits.topk(2, dim=-1)
            for row in range(bs):
                logits[row, top.indices[row, 1]] = logits[row, top.indices[row, 0]] - float(gaps[row])
            tokens = logits.argmax(-1)
            if r == odd_rank and not eager:
                logits.view(torch.int32)[0, 5] ^= 1  # the other kernel's last-bit difference
            if r == odd_rank and s == flip_at:
                tokens[0] = top.indices[0, 1]
            if diverged:
                tokens = torch.randint(0, VOCAB, (bs,), generator=odd_stream)
            n_acc = torch.randint(0, 4, (bs,), generator=odd_stream if diverged else g) + 1
            rec.record_outputs(logits=logits, tokens=tokens, accepted=n_acc)
            if eager:
                reason = "prefill: no graph for this shape" if s % 50 == 25 else "static argument hash changed"
                rec.set_run("eager", reason=reason)
            else:
                padded = bucket_of(bs)
                rec.record_graph_replay(gids[padded])
                rec.set_run("graph", key=f"decode-bs{padded}", padded_size=padded)
            rec.end_step()
        rec.close()
        if rec.error is not None:
            raise SystemExit(f"report-check: recording the demo failed: {rec.error}")
    _demo_results(out / "results", odd_rank, flip_at)
    return out


def _demo_results(folder: Path, rank: int, step: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    verdict = lambda a, b, v, m, u, agree: {
        "a": a, "b": b, "verdict": v, "max_abs": m, "max_rel": m / 7.5 if m else 0.0, "ulp": u,
        "argmax_agree": agree, "topk_overlap": 1.0 if agree else 0.8, "margin": 0.0039,
    }
    results = {
        "step-r2-s212.json": {
            "kind": "step", "rank": rank, "step": step, "part": "run-000", "device": "cuda:0", "keyframe": 200,
            "modes": {"eager": {"repeats_equal": True, "departed": None}, "cudagraph": {"repeats_equal": True, "departed": None}},
            "verdicts": [
                dict(verdict("eager", "cudagraph", "different", 0.0078, 2, False), mismatched=3, numel=512, output="logits"),
                dict(verdict("recording", "cudagraph", "bitwise equal", 0.0, 0, True), output="logits"),
                dict(verdict("recording", "eager", "different", 0.0078, 2, False), mismatched=3, numel=512, output="logits"),
            ],
        },
        "bisect-steps.json": {"kind": "bisect-steps", "first": 0, "ranks": [rank], "part": "run-000", "probes": 9},
        "bisect-layers-r2-s212.json": _demo_layers(rank, step),
        "bisect-config-r2-s212.json": {
            "kind": "bisect-config", "rank": rank, "step": step,
            "toggles": [
                {"toggles": ["cudagraph=off"], "outcome": "ranks agree"},
                {"toggles": ["tuner=off"], "outcome": "ranks agree"},
                {"toggles": ["deterministic=on"], "outcome": "still differs"},
                {"toggles": ["tf32=off"], "outcome": "still differs"},
            ],
            "minimal": ["tuner=off"],
        },
    }
    for name, obj in results.items():
        (folder / name).write_text(json.dumps(obj, indent=1))


def _demo_layers(rank: int, step: int) -> dict:
    mods = []
    err = 0.0
    for layer in range(6):
        for sub in ("attn", "moe.router", "moe.experts", "moe.combine", "recurrent"):
            name = f"layers.{layer}.{sub}"
            if name == "layers.2.moe.experts":
                err = 0.0039
            elif err:
                err *= 1.3
            v = "bitwise equal" if err == 0 else "within tolerance" if err < 0.02 else "different"
            mods.append({"name": name, "verdict": v, "max_abs": err, "max_rel": err / 4})
    mods.append({"name": "lm_head", "verdict": "different", "max_abs": err * 2, "max_rel": err / 2})
    return {"kind": "bisect-layers", "rank": rank, "step": step, "between": ["eager", "cudagraph"], "modules": mods, "first": "layers.2.moe.experts"}


# -- main -----------------------------------------------------------------------------------


def _shrink_png(src: Path, dst: Path, max_bytes: int = 500_000) -> None:
    """Copy ``src`` to ``dst``, scaled down and palette-quantised until it is under ``max_bytes``."""
    from PIL import Image

    img = Image.open(src).convert("RGB")
    # Trim the empty page background below the last section.
    arr = np.asarray(img)
    rows = np.flatnonzero((np.abs(arr.astype(int) - arr[-1, -1].astype(int)).sum(-1) > 12).any(1))
    if rows.size:
        img = img.crop((0, 0, img.width, min(img.height, int(rows[-1]) + 24)))
    width = img.width
    while True:
        im = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS) if width != img.width else img
        im.quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(dst, optimize=True)
        if dst.stat().st_size <= max_bytes or width < 700:
            return
        width = int(width * 0.85)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recording", nargs="?", type=Path, help="recording directory (default: the newest under --root)")
    ap.add_argument("--root", default="recordings", help="where to look for the newest recording")
    ap.add_argument("--demo", action="store_true", help="build the synthetic demo recording and use it")
    ap.add_argument("--docs", action="store_true", help="also save docs/img/report.png and docs/img/report-example.html")
    ap.add_argument("--png", type=Path, default=None, help="screenshot path (default: beside the report)")
    ap.add_argument("--height", type=int, default=None, help="window height in pixels (default 3000; 6000 with --docs, then trimmed)")
    args = ap.parse_args(argv)
    args.png = args.png.resolve() if args.png else None
    args.recording = args.recording.resolve() if args.recording else None

    from replay.errors import ReplayError
    from replay.format.reader import resolve_recording
    from replay.report import build_report, write_report

    if find_chromium() is None:
        print("report-check: chromium not found: apt-get install chromium", file=sys.stderr)
        return 2
    try:
        if args.demo:
            if args.recording is not None:
                rec = args.recording
            else:
                # Work from a scratch folder so the page names the recording as users see theirs.
                os.chdir(tempfile.mkdtemp(prefix="replay-demo-"))
                rec = Path("recordings") / "20261130-120000-demo"
            if rec.exists():
                shutil.rmtree(rec)
            t = time.perf_counter()
            demo_recording(rec)
            print(f"report-check: demo recording {rec.resolve()} ({time.perf_counter() - t:.1f} s)")
        else:
            rec, _ = resolve_recording(args.recording, args.root)
        t = time.perf_counter()
        page = write_report(build_report(rec))
        page = page.resolve()
        print(f"report-check: report {page} ({page.stat().st_size / 1e3:.0f} kB, {time.perf_counter() - t:.1f} s)")
    except ReplayError as e:
        hint = "" if args.demo or args.recording else " (or pass --demo for a synthetic one)"
        print(f"report-check: {e}{hint}", file=sys.stderr)
        return 1
    png = args.png or page.with_suffix(".png")
    t = time.perf_counter()
    try:
        screenshot(page, png, height=args.height or (6000 if args.docs else 3000))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    print(f"report-check: screenshot {png} ({time.perf_counter() - t:.1f} s)")
    if args.docs:
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        _shrink_png(png, DOCS_IMG / "report.png")
        print(f"report-check: wrote {DOCS_IMG / 'report.png'} ({(DOCS_IMG / 'report.png').stat().st_size / 1e3:.0f} kB)")
        if page.stat().st_size < 1_000_000:
            shutil.copyfile(page, DOCS_IMG / "report-example.html")
            print(f"report-check: wrote {DOCS_IMG / 'report-example.html'}")
        else:
            print("report-check: report is over 1 MB, not copied to docs/img/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
