"""Digest throughput, side by side in one run: rd64 (``replay.digest``), ``torch.hash_tensor`` and
a naive position-weighted digest in plain torch, plus a plain read and a copy for reference.

    python benchmarks/bench_digest.py                   # GPU if any (1 GiB), else CPU (64 MiB)
    python benchmarks/bench_digest.py --device cpu --size 256MiB
    python benchmarks/bench_digest.py --json            # the same figures as JSON
    python benchmarks/bench_digest.py --sweep           # GPU: rd64 under many launch shapes

Throughput is the tensor's bytes divided by the median time of one call. GPU times come from CUDA
events around each call after a warm-up; CPU times from ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout, installed or not

from replay.digest import (  # noqa: E402
    _digest_numpy_reference,
    digest,
    digest_into,
    digest_numpy,
    from_int64,
    warmup,
)

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"64MiB"``, ``"1e9"`` or ``"123"`` as a byte count."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 1GiB, 64MiB, 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def naive_torch_digest(t: torch.Tensor) -> torch.Tensor:
    """The digest people write in plain torch: int64 words times odd position weights, summed.

    Position-sensitive, but its weights and products take three tensors of the input's size;
    bytes past the last whole int64 are ignored. It is not rd64 and need not equal it.
    """
    flat = t.reshape(-1).view(torch.uint8)
    words = flat[: flat.numel() // 8 * 8].view(torch.int64)  # [n // 8]
    weights = torch.arange(words.numel(), device=t.device, dtype=torch.int64) * 2 + 1  # [n // 8]
    return (words * weights).sum()  # int64 sums wrap modulo 2**64


@dataclass(slots=True)
class Row:
    method: str
    seconds: float
    """Median time of one call."""
    gb_per_s: float
    note: str = ""


@dataclass(slots=True)
class Report:
    date: str
    device: str
    machine: str
    size_bytes: int
    dtype: str
    reps: int
    versions: dict[str, str]
    command: str
    rows: list[Row] = field(default_factory=list)
    verified: str = ""
    sweep: list[dict[str, object]] = field(default_factory=list)


def _time_host(fn: Callable[[], object], reps: int, warm: int, sync: bool) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_cuda(fn: Callable[[], object], reps: int, warm: int) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) / 1e3


def _machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpu = f"{cpu}, {os.cpu_count()} CPUs"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); host {cpu}"
    return cpu


def _versions() -> dict[str, str]:
    import numpy

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except Exception:  # any failure to import means "not available" here
        versions["triton"] = "not available"
    return versions


def _make_tensor(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    item = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)
    raw = torch.randint(
        0, 256, (size // item * item,), dtype=torch.uint8, device=device, generator=g
    )
    return raw.view(dtype)  # random bits, NaNs and all: a digest must not care


def run(
    size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    reps: int | None = None,
    verify: bool = True,
) -> Report:
    """Time every method on one tensor of ``size`` bytes on ``device``."""
    gpu = device.type == "cuda"
    reps = reps or (50 if gpu else 5)
    warm = 5 if gpu else 1
    t = _make_tensor(size, dtype, device)
    report = Report(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 (3.10)
        device=str(device),
        machine=_machine(device),
        size_bytes=t.numel() * t.element_size(),
        dtype=str(dtype).removeprefix("torch."),
        reps=reps,
        versions=_versions(),
        command="python " + shlex.join(sys.argv),
    )
    methods: list[tuple[str, Callable[[], object], str, bool]] = []  # name, call, note, host-timed
    if gpu:
        warmup(device)
        out = torch.zeros(1, dtype=torch.int64, device=device)
        methods.append(
            (
                "rd64 `digest_into` (replay.digest)",
                lambda: digest_into(t, out, 0),
                "device only, capturable",
                False,
            )
        )
        graph = torch.cuda.CUDAGraph()
        digest_into(t, out, 0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            digest_into(t, out, 0)
        methods.append(("rd64 in a CUDA graph (replay)", graph.replay, "graph.replay()", False))
        methods.append(
            (
                "rd64 `digest` (replay.digest)",
                lambda: digest(t),
                "with the host sync for the int",
                True,
            )
        )
    else:
        methods.append(
            ("rd64 `digest` (replay.digest)", lambda: digest(t), "numpy, one thread", True)
        )
    if hasattr(torch, "hash_tensor"):
        methods.append(
            (
                "torch.hash_tensor",
                lambda: torch.hash_tensor(t),
                "xor of 64-bit upcasts: order-blind",
                False,
            )
        )
    methods.append(
        ("naive torch (int64 words * weights).sum()", lambda: naive_torch_digest(t), "", False)
    )
    words = (
        t.reshape(-1).view(torch.uint8)[: t.numel() * t.element_size() // 4 * 4].view(torch.int32)
    )
    methods.append(("reference: int32 sum (one read)", lambda: words.sum(), "not a digest", False))
    dst = torch.empty_like(t)
    methods.append(
        ("reference: copy", lambda: dst.copy_(t), "not a digest; moves 2x the bytes", False)
    )

    for name, fn, note, host in methods:
        if gpu and not host:
            seconds = _time_cuda(fn, reps, warm)
        else:
            seconds = _time_host(fn, reps, warm, sync=gpu)
        report.rows.append(Row(name, seconds, report.size_bytes / seconds / 1e9, note))

    if verify:
        if gpu:
            expected = digest_numpy(t.reshape(-1).view(torch.uint8).cpu().numpy())
            graph.replay()
            got = {"digest": digest(t), "graph replay": from_int64(int(out.item()))}
            wrong = {k: f"{v:016x}" for k, v in got.items() if v != expected}
            report.verified = (
                f"GPU (digest and graph replay) == CPU, {expected:016x}"
                if not wrong
                else f"MISMATCH: CPU {expected:016x}, GPU {wrong}"
            )
        else:
            head = t.reshape(-1).view(torch.uint8)[: 4 << 20].numpy()
            same = digest_numpy(head) == _digest_numpy_reference(head)
            report.verified = (
                "fast CPU path == reference (first 4 MiB)"
                if same
                else "MISMATCH with the reference"
            )
    return report


def sweep(size: int, device: torch.device, reps: int = 30) -> list[dict[str, object]]:
    """rd64 under many launch shapes (all give the same digest), fastest first."""
    from replay import _digest_triton as k

    flat = _make_tensor(size, torch.uint8, device)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    results: list[dict[str, object]] = []
    for block, warps, mode in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16), (0, 1, 2)):
        if not 4 <= block // (32 * warps) <= 32:  # words per thread per iteration
            continue
        for per_sm in (2, 4, 32):  # 32: as many as fit on an SM
            config = k.KernelConfig(
                block=block, num_warps=warps, programs_per_sm=per_sm, shift_mode=mode
            )
            seconds = _time_cuda(
                functools.partial(k.accumulate_digest, flat, out, 0, config=config), reps, 3
            )
            fit = k._fit_per_sm.get((device.index or 0, config, False, True))
            results.append(
                {
                    **asdict(config),
                    "programs_per_sm_used": fit,
                    "seconds": seconds,
                    "gb_per_s": size / seconds / 1e9,
                }
            )
    return sorted(results, key=lambda r: -float(r["gb_per_s"]))  # type: ignore[arg-type]


def render_markdown(report: Report) -> str:
    lines = [
        f"### Digest throughput: {report.size_bytes / (1 << 20):,.0f} MiB of {report.dtype}"
        f" on {report.device}",
        "",
        f"- date: {report.date}",
        f"- machine: {report.machine}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()),
        f"- command: `{report.command}`",
        f"- median of {report.reps} runs; GB/s = tensor bytes / time (10^9 bytes)",
    ]
    if report.verified:
        lines.append(f"- check: {report.verified}")
    lines += ["", "| method | GB/s | ms | note |", "| --- | ---: | ---: | --- |"]
    lines += [
        f"| {r.method} | {r.gb_per_s:,.1f} | {r.seconds * 1e3:,.3f} | {r.note} |"
        for r in report.rows
    ]
    if report.sweep:
        lines += [
            "",
            "| block | warps | shift_mode | programs/SM (asked, used) | GB/s |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in report.sweep:
            lines.append(
                f"| {r['block']} | {r['num_warps']} | {r['shift_mode']} | {r['programs_per_sm']}, "
                f"{r['programs_per_sm_used']} | {float(r['gb_per_s']):,.1f} |"  # type: ignore[arg-type]
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--size",
        type=parse_size,
        default=None,
        help="tensor bytes (default 1GiB on GPU, 64MiB on CPU)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="torch dtype of the tensor (default float32)"
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="timed runs per method (default 50 GPU, 5 CPU)"
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="skip checking the GPU digest against the CPU"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="GPU: also time rd64 under many launch shapes"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = args.size or ((1 << 30) if device.type == "cuda" else (64 << 20))
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(
            f"unknown dtype {args.dtype!r}; use a torch dtype name such as float32 or bfloat16"
        )
    if args.sweep and device.type != "cuda":
        parser.error("--sweep needs a CUDA device")
    report = run(size, device, dtype, args.reps, verify=not args.no_verify)
    if args.sweep:
        report.sweep = sweep(size, device)
    print(json.dumps(asdict(report), indent=2) if args.json else render_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
