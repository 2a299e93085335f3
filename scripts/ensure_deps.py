"""Install what replay and its tests need, keeping whatever is already installed.

torch: an existing install (CPU or CUDA) is kept; with none, the CPU build is installed
(`torch==2.13.0`, which pip takes from this machine's local wheel cache; elsewhere from the
PyTorch CPU index). Other packages are installed only when missing, so this works offline on a
machine that has them (the GPU machine) and does nothing on a second run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

CPU_TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# import name -> pip requirement
NEEDED = {
    "h5py": "h5py>=3.8",
    "click": "click>=8.1",
    "numpy": "numpy>=1.24",
    "pytest": "pytest>=7.4",
    "pytest_timeout": "pytest-timeout>=2.1",
    # `make test` runs on two pytest workers (`-n 2`, tests/conftest.py groups shared fixtures).
    "xdist": "pytest-xdist>=3.5",
    "hypothesis": "hypothesis>=6.80",
    "matplotlib": "matplotlib>=3.7",
    # The "model nobody here wrote" that tests the generic path (tests/test_hf.py).
    "transformers": "transformers>=4.46",
}


def pip(*args: str) -> int:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def main() -> int:
    if importlib.util.find_spec("torch") is None:
        # Plain first: on this workplace's machines pip finds the CPU wheel on disk. Elsewhere
        # plain `torch` could be a CUDA build, so fall back to the CPU index explicitly.
        if pip(CPU_TORCH) != 0 and pip(CPU_TORCH, "--index-url", CPU_INDEX) != 0:
            print("could not install torch; install a CPU or CUDA build of torch and re-run", file=sys.stderr)
            return 1
    missing = [req for mod, req in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if missing and pip(*missing) != 0:
        return 1
    # replay itself, editable, for the `replay` command and the pytest plugin; no dependencies
    # and no build isolation, so this works offline.
    try:
        importlib.metadata.distribution("replay")
    except importlib.metadata.PackageNotFoundError:
        root = str(Path(__file__).resolve().parents[1])
        if pip("--no-deps", "--no-build-isolation", "-e", root) != 0:
            print("could not install replay itself; the `replay` command will be missing (use python -m replay)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
