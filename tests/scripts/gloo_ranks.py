"""Launch N gloo ranks of ``gloo_engine.Engine`` on CPU, like a tiny torchrun.

    python tests/scripts/gloo_ranks.py --dir OUT --world 2 --steps 50 [--raise-at 1:7] [--hang-at 1:7]

Each rank appends one line per *completed* step to ``OUT/progress-<rank>.txt`` (written with one
``write`` call right after the step returned, so a SIGKILL leaves only whole lines), holding the
step's input and output bytes in hex (``--log exact``) or just the step number (``--log count``).
``OUT/pid-<rank>`` holds each rank's pid, so a test can kill ranks at chosen moments.

Ranks are forked from this process (cheap: torch is imported once) or started as fresh
interpreters (``--start spawn``, as torchrun does). The launcher's exit code is the largest of
its ranks' (128 + N for a rank ended by signal N), so it does not depend on which rank failed
first. When a rank fails, the others get ``--grace`` seconds to end on their own and are then
sent SIGTERM: the program's own timeout, which ends a hung collective.

Nothing here imports ``replay``: it is the program being recorded.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from gloo_engine import Engine


def _rank_fault(spec: str | None, rank: int) -> int | None:
    """``"R:S"`` -> S when this is rank R (``*`` matches every rank)."""
    if not spec:
        return None
    r, _, s = spec.partition(":")
    return int(s) if r in ("*", str(rank)) else None


def rank_main(rank: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    d = a.dir
    with open(os.path.join(d, f"pid-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(d, 'store')}",
        rank=rank,
        world_size=a.world,
        timeout=timedelta(seconds=a.pg_timeout),
    )
    eng = Engine(
        rank,
        width=a.width,
        raise_at=_rank_fault(a.raise_at, rank),
        hang_at=_rank_fault(a.hang_at, rank),
        step_sleep=a.step_sleep,
    )
    fd = os.open(os.path.join(d, f"progress-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    x = torch.linspace(-1.0, 1.0, 2 * a.width).reshape(2, a.width)  # x: [2, width]
    for i in range(a.steps):
        y = eng.step(x, i)
        if a.log == "exact":
            os.write(fd, f"{i} {x.numpy().tobytes().hex()} {y.numpy().tobytes().hex()}\n".encode())
        elif a.log == "count":
            os.write(fd, f"{i}\n".encode())
        x = y
    os.close(fd)
    dist.destroy_process_group()


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _fork_rank(rank: int, a: argparse.Namespace) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        rank_main(rank, a)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a rank's failure is its exit code, as in a real launcher
        traceback.print_exc()
        code = 1
    finally:
        # What a normal interpreter exit would run (recorders close here), then leave without
        # running the parent's cleanup twice.
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return -1  # not reached


def _spawn_rank(rank: int, argv: list[str]) -> int:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--as-rank", str(rank)]).pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--raise-at", default=None, metavar="RANK:STEP")
    p.add_argument("--hang-at", default=None, metavar="RANK:STEP")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pg-timeout", type=float, default=20.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--log", choices=["exact", "count", "none"], default="exact")
    p.add_argument("--start", choices=["fork", "spawn"], default="fork")
    p.add_argument("--as-rank", type=int, default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    a.dir = os.path.abspath(a.dir)  # the file:// rendezvous needs an absolute path
    os.makedirs(a.dir, exist_ok=True)
    if a.as_rank is not None:
        rank_main(a.as_rank, a)
        return 0
    pids = [(_fork_rank(r, a) if a.start == "fork" else _spawn_rank(r, argv)) for r in range(a.world)]
    codes: dict[int, int] = {}
    failed_at: float | None = None
    termed = False
    while len(codes) < len(pids):
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        except KeyboardInterrupt:
            continue  # Ctrl-C reached the ranks too: wait for them to end
        if pid:
            codes[pid] = _exit_code(status)
            if codes[pid] and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and not termed and time.monotonic() - failed_at > a.grace:
            termed = True
            for q in pids:
                if q not in codes:
                    try:
                        os.kill(q, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        try:
            time.sleep(0.02)
        except KeyboardInterrupt:
            continue
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
