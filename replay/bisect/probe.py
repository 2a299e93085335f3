"""Probes of a configuration bisection, each in fresh processes.

A probe re-runs one recorded step under a set of toggle values and reports the digests of its
outputs. Toggles such as TF32, deterministic algorithms or a CUDA graph leave state behind in a
process (numerics flags, captured graphs, allocator pools, a tuner's cache), so no probe runs in
the bisecting process or in a process an earlier probe used:

- one rank (or two, one after the other) with recorded collectives: ``python -m
  replay.bisect.probe REQUEST RESULT``, a subprocess that reads a JSON request and writes a JSON
  result (an internal entry point, not a command);
- all ranks with live collectives: one spawned process per rank (torch.multiprocessing), joined
  in a process group (gloo on the CPU, NCCL on GPUs), each writing its JSON result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["SideRequest", "main", "run_live", "run_single"]

SideRequest = dict[str, Any]  # {"label", "rank", "mode", "options", "data": the rank whose recording to replay}


def _replay_side(part: Any, side: SideRequest, step: int, *, device: str, factory: str | None, live: bool) -> dict[str, Any]:
    """Re-run ``step`` as ``side``; digests of its outputs (or the error that stopped it)."""
    from replay.digest import digest
    from replay.errors import ReplayError
    from replay.rerun.runner import Replayer

    data_rank = int(side["data"] if side.get("data") is not None else side["rank"])
    out: dict[str, Any] = {"label": side["label"], "rank": side["rank"], "data": data_rank, "mode": side["mode"],
                           "digests": {}, "reproduces": None, "error": None, "toggles": None, "departed": None,
                           "params": None}
    t0 = time.perf_counter()
    rp = None
    try:
        rp = Replayer(part, data_rank, mode=side["mode"], device=device, factory=factory,
                      options=dict(side.get("options") or {}), live_collectives=live, as_rank=int(side["rank"]))
        kf, _ = rp.keyframe_for(step)
        rp.check(kf, step)
        target = rp.build()
        out["toggles"] = target.toggles()
        model = target.module()
        if model is not None:
            from replay.format.tables import combine_digests

            out["params"] = f"{combine_digests(digest(p.detach()) for _, p in model.named_parameters()):016x}"
        dep = rp.goto(step)
        outs = rp.run(step)
        out["digests"] = {k: f"{digest(v):016x}" for k, v in outs.items()}
        out["reproduces"] = rp.departure(step, outs) is None
        out["departed"] = str(dep) if dep else None
        if rp.last_error:
            out["error"] = f"the step raised: {rp.last_error}"
    except ReplayError as e:
        out["error"] = str(e)
    except Exception as e:  # noqa: BLE001 - the target is user code; report, never a traceback
        out["error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        if rp is not None:
            rp.close()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _use_paths(paths: list[str]) -> None:
    # The factory must import here as it did in the bisecting process (pytest's rootdir, a
    # checkout on sys.path): take its search path.
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)


def serve(request: dict[str, Any]) -> dict[str, Any]:
    """Run a single-process probe request (in the probe process)."""
    from replay.format.reader import Recording

    _use_paths(list(request.get("sys_path") or []))
    with Recording(request["recording"]) as rec:
        part = rec[request["part"]]
        sides = [_replay_side(part, s, int(request["step"]), device=request["device"], factory=request.get("factory"),
                              live=False) for s in request["sides"]]
    return {"sides": sides}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m replay.bisect.probe REQUEST.json RESULT.json (internal to replay bisect config)", file=sys.stderr)
        return 2
    request = json.loads(Path(args[0]).read_text())
    try:
        result = serve(request)
    except Exception as e:  # noqa: BLE001 - the parent reads the reason from the result file
        result = {"error": f"{e.__class__.__name__}: {e}", "sides": []}
    Path(args[1]).write_text(json.dumps(result, default=str))
    return 0


def run_single(request: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Run a probe request in a fresh ``python -m replay.bisect.probe`` process."""
    request = dict(request, sys_path=[p for p in sys.path if p and Path(p).is_dir()])
    with tempfile.TemporaryDirectory(prefix="replay-probe-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request, default=str))
        try:
            proc = subprocess.run([sys.executable, "-m", "replay.bisect.probe", str(req), str(res)],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"the probe did not finish within {timeout_s:.0f} s", "sides": []}
        if res.exists():
            return dict(json.loads(res.read_text()))
        tail = (proc.stderr or "").strip().splitlines()
        return {"error": f"the probe process exited with code {proc.returncode}" + (f": {tail[-1]}" if tail else ""), "sides": []}


def _live_worker(i: int, args: dict[str, Any]) -> None:
    side = args["sides"][i]
    device = args["devices"][i]
    out = Path(args["out"]) / f"{i}.json"
    data: dict[str, Any]
    try:
        _use_paths(args["sys_path"])
        import torch
        import torch.distributed as dist

        from replay.format.reader import Recording

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["port"]), RANK=str(side["rank"]))
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=int(side["rank"]), world_size=args["world"])
        try:
            with Recording(args["recording"]) as rec:
                data = _replay_side(rec[args["part"]], side, args["step"], device=device, factory=args["factory"], live=True)
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - report, never a traceback
        data = {"label": side["label"], "rank": side["rank"], "digests": {}, "error": f"{e.__class__.__name__}: {e}"}
    out.write_text(json.dumps(data, default=str))


def run_live(request: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Run every rank of the step at once, one fresh process per rank, with live collectives."""
    import torch.multiprocessing as mp

    sides = request["sides"]
    devices = request["devices"]
    from replay.rerun.multi import free_port

    with tempfile.TemporaryDirectory(prefix="replay-probe-") as tmp:
        args = {**request, "out": tmp, "port": free_port(), "world": len(sides),
                "sys_path": [p for p in sys.path if p and Path(p).is_dir()], "devices": devices}
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_live_worker, args=(i, args), name=f"replay-probe-rank{s['rank']}") for i, s in enumerate(sides)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
        results = []
        for i, s in enumerate(sides):
            f = Path(tmp) / f"{i}.json"
            if f.exists():
                results.append(json.loads(f.read_text()))
            else:
                results.append({"label": s["label"], "rank": s["rank"], "digests": {},
                                "error": "the rank's process died or timed out"})
    return {"sides": results}


if __name__ == "__main__":  # pragma: no cover - run as a subprocess
    sys.exit(main())
