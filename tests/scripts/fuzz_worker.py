"""Runs ``replay`` commands for the fuzzer (tests/test_fuzz.py), one per line of stdin.

In:  one JSON object a line: {"argv": [...], "cwd": "..."}
Out: one JSON object a line: {"code", "out", "err", "secs", "rss_mb"}

A separate process, so that one case that crashes the interpreter (a segfault in a C library
reading a hostile file), hangs, or allocates without bound is counted and the fuzzer goes on
with a fresh worker, instead of taking pytest down. torch and h5py are imported once, so a case
costs milliseconds, not the seconds an interpreter takes to start. The address space is capped
(``--max-gb`` above what the imports took): a case that tries to allocate more gets a
MemoryError, which the CLI must report as one error line (exit 4), never an internal error; the
reader refuses a file that claims more than it stores before it allocates anything. The worker
inherits ``$REPLAY_FUZZ_SECRET``, so a case that reads the environment through a rank file
(external storage in ``/proc/self/environ``) is seen by the fuzzer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import sys
import time

from replay.cli.main import main


def _vm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-gb", type=float, default=3.0)
    a = p.parse_args()
    # Import what the commands import, before the cap: it is not what is being measured.
    import importlib

    for name in ("replay.analysis.summary", "replay.analysis.verify", "replay.cli.info", "replay.cli.seal",
                 "replay.cli.verify", "replay.cli.report", "replay.cli.step", "replay.cli.bisect"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # a command that is not there yet is not fuzzed
    limit = _vm_bytes() + int(a.max_gb * (1 << 30))
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass
    real_out = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        os.chdir(req.get("cwd") or ".")
        out, err = io.StringIO(), io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(x) for x in req["argv"]])
            except BaseException as e:  # noqa: BLE001 - main() must not raise; if it does, say so
                code = -1
                err.write(f"main() raised {e.__class__.__name__}: {e}\n")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res = {"code": code, "out": out.getvalue()[-16000:], "err": err.getvalue()[-4000:],
               "secs": time.monotonic() - t0, "rss_mb": rss}
        real_out.write(json.dumps(res) + "\n")
        real_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run())
