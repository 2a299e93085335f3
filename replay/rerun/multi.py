"""Re-running one step on several ranks at once: one process per rank.

Where every rank of the run is re-run and each sits on its own device (or all on the CPU), the
ranks talk through a real process group (gloo on the CPU, NCCL on GPUs), so collectives are live.
Otherwise each rank replays its recorded collectives. All ranks start from the same keyframe so
they stay in lockstep.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from replay.errors import ReplayError, UsageError
from replay.format.reader import Recording

__all__ = ["rerun_ranks", "plan_devices", "free_port"]


def plan_devices(ranks: list[int], devices: str | None) -> list[str]:
    if not devices:
        return ["cpu"] * len(ranks)
    devs = [d.strip() for d in devices.split(",") if d.strip()]
    for d in devs:
        if d != "cpu" and not d.startswith("cuda"):
            raise UsageError(f"--devices: {d!r} is not cpu or cuda:N")
        if d.startswith("cuda") and (not torch.cuda.is_available() or int(d.partition(":")[2] or 0) >= torch.cuda.device_count()):
            raise UsageError(f"--devices: {d} is not available here ({torch.cuda.device_count()} CUDA devices)")
    return [devs[i % len(devs)] for i in range(len(ranks))]


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(i: int, args: dict[str, Any]) -> None:
    rank = args["ranks"][i]
    device = args["devices"][i]
    out = Path(args["out"]) / f"{rank}.json"
    live = args["live"]
    try:
        if live:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["port"]))
            backend = "nccl" if device.startswith("cuda") else "gloo"
            if device.startswith("cuda"):
                torch.cuda.set_device(device)
            dist.init_process_group(backend, rank=rank, world_size=args["world"])
        from replay.rerun.runner import RerunOptions, rerun_step

        settings = RerunOptions(modes=tuple(args["modes"]), device=device, repeat=args["repeat"], factory=args["factory"],
                                options=args["options"], recording=args["recording"], live_collectives=live,
                                keyframe_at=args["keyframe"])
        with Recording(args["recording"]) as rec:
            r = rerun_step(rec[args["part"]], rank, args["step"], settings)
        data = r.to_json()
        data["collectives"] = "live" if live else "recorded"
    except ReplayError as e:
        data = {"rank": rank, "step": args["step"], "error": str(e)}
    except Exception as e:  # noqa: BLE001 - report, never a traceback
        data = {"rank": rank, "step": args["step"], "error": f"{e.__class__.__name__}: {e}"}
    finally:
        if live:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    out.write_text(json.dumps(data, default=str))


def rerun_ranks(
    recording: Path,
    part: str,
    ranks: list[int],
    step: int,
    *,
    modes: list[str],
    devices: str | None,
    repeat: int = 1,
    factory: str | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Re-run ``step`` on each of ``ranks``; one result dict per rank (``error`` on failure)."""
    with Recording(recording) as rec:
        p = rec[part]
        world = p.world_size
        for r in ranks:
            p[r].step(step)
        kfs = [p[r].keyframe(step) for r in ranks]
        keyframe = min(k[0] for k in kfs) if all(k is not None for k in kfs) else None
    devs = plan_devices(ranks, devices)
    distinct = all(d == "cpu" for d in devs) or len(set(devs)) == len(devs)
    live = ranks == list(range(world)) and distinct and world > 1
    with tempfile.TemporaryDirectory(prefix="replay-ranks-") as tmp:
        args = {
            "ranks": ranks, "devices": devs, "out": tmp, "live": live, "port": free_port(), "world": world,
            "recording": str(recording), "part": part, "step": step, "modes": modes, "repeat": repeat,
            "factory": factory, "options": options or {}, "keyframe": keyframe,
        }
        if live:
            mp.spawn(_worker, args=(args,), nprocs=len(ranks), join=True)
        else:
            for i in range(len(ranks)):
                ctx = mp.get_context("spawn")
                proc = ctx.Process(target=_worker, args=(i, args))
                proc.start()
                proc.join()
        results = []
        for r in ranks:
            f = Path(tmp) / f"{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "step": step, "error": "the rank's process died"})
    return results
