"""Figures for docs/security.md: time and peak-memory growth of `replay info` on each hostile
rank file of tests/test_fuzz.py (issue 16), in one process, after the imports.

    PYTHONPATH=. python tests/scripts/hostile_figures.py [--json]
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import replay.analysis.summary  # noqa: E402,F401 - imported before measuring
import replay.cli.info  # noqa: E402,F401
import tests.test_fuzz as tf  # noqa: E402
from replay.cli.main import main  # noqa: E402


def run() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        tf.record_rich(root / "base")
        for fn in (tf._external_strings, tf._external_link, tf._soft_link, tf._virtual, tf._sparse_huge, tf._sparse_chunked):
            case = root / fn.__name__.strip("_")
            shutil.copytree(root / "base", case, symlinks=True)
            fn(case)
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                code = main(["info", str(case)])
            rows.append({"case": case.name, "exit": code, "seconds": round(time.perf_counter() - t0, 3),
                         "rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024, 1)})
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['case']:<18} exit {r['exit']}  {r['seconds']:.3f} s  +{r['rss_growth_mb']} MB peak RSS")
    return 0


if __name__ == "__main__":
    sys.exit(run())
