"""The run manifest (``manifest.json``) and the facts about a host worth keeping with a recording.

JSON rather than HDF5: it is small, written by the launcher (not the ranks), and a person reads it
first. Each node's launcher writes its own file (``manifest.json`` on node 0, ``manifest.node<k>.json``
elsewhere) so nodes sharing a filesystem never overwrite each other; readers merge them.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

from replay.format import perms
from replay.format.schema import FORMAT_VERSION

__all__ = [
    "RECORDING_KIND",
    "STDIN_COPY",
    "write_manifest",
    "read_manifests",
    "host_facts",
    "numerics_env",
    "versions",
    "create_exclusive",
    "manifest_name",
    "claim_recording",
    "stdin_id",
]

RECORDING_KIND = "replay-recording"
# CMD's stdin as `replay record` kept it, beside the manifest (written by replay/record/wrapper.py,
# given back to a re-launched program by replay/rerun/relaunch.py).
STDIN_COPY = "stdin.bin"
_MAX_MANIFEST_BYTES = 16 << 20

# Environment that changes numerics or collective algorithms: kept with every rank file.
_ENV_PREFIXES = ("NCCL_", "CUBLAS_", "CUBLASLT_", "TORCH_", "CUDA_", "PYTORCH_", "TRITON_", "NVIDIA_TF32")
_ENV_EXACT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def stdin_id(fd: int) -> str | None:
    """The identity of what ``fd`` is open on (``dev:inode``; both ends of a pipe share one), or
    None: the command's stdin in the manifest, each recorded process's in its launch facts."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def numerics_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_EXACT}


def versions() -> dict[str, Any]:
    import h5py
    import torch

    v: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "h5py": h5py.__version__,
        "hdf5": h5py.version.hdf5_version,
        "cuda": torch.version.cuda,
        "replay_format": FORMAT_VERSION,
    }
    from replay._version import __version__  # arch (#18): the version from one place, not the package root

    v["replay"] = __version__
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            pass
        v["driver"] = _driver_version()
    return v


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as fh:
            line = fh.readline()
        return line.split("Kernel Module")[1].split()[0] if "Kernel Module" in line else line.strip()
    except OSError:
        return None


def numerics_flags() -> dict[str, Any]:
    import torch

    flags: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        flags["cuda_matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        flags["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        flags["cuda_matmul_allow_bf16_reduced_precision_reduction"] = (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        )
        flags["cuda_matmul_allow_fp16_reduced_precision_reduction"] = (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        )
    except AttributeError:
        pass
    return flags


def host_facts() -> dict[str, Any]:
    """Facts about this process's host that belong in its rank file (cheap; no CUDA init)."""
    import torch

    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "node_rank": _int_env("GROUP_RANK", _int_env("NODE_RANK", _int_env("SLURM_NODEID", None))),
        "local_rank": _int_env("LOCAL_RANK", None),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts


def _int_env(name: str, default: int | None) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def create_exclusive(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` only if it does not exist yet, atomically. True if written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    perms.write_new(tmp, text.encode())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def write_manifest(recording: Path, data: dict[str, Any], *, node: int | None = None, replace: bool = True) -> Path:
    """Write this launcher's manifest file atomically (``replace=False``: only if absent)."""
    name = "manifest.json" if not node else f"manifest.node{node}.json"
    path = recording / name
    body = {"format_version": FORMAT_VERSION, "kind": RECORDING_KIND, "written_at": time.time(), **data}
    text = json.dumps(body, indent=2, sort_keys=True, default=str)
    if not replace:
        create_exclusive(path, text)
        return path
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        perms.write_new(tmp, text.encode())  # the recording's file mode, whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a stray empty file behind
        raise
    return path


def manifest_name(node: int | None) -> str:
    return "manifest.json" if not node else f"manifest.node{node}.json"


def claim_recording(out: Path, node: int | None, *, add: bool = False) -> str | None:
    """Make ``out`` this launcher's recording, atomically; None if done, else why it cannot be.

    A directory that already holds a recording is refused, so that two commands never share one
    recording and a last-writer manifest: unless ``add`` (the user asks to add to it), or this
    is another node of the same multi-node run (each node claims its own manifest file, and
    only a node rank says there are several). The claim is a manifest saying the recording is
    starting, created only if absent; ``replay record`` then rewrites it.
    """
    name = manifest_name(node)
    if not add:
        _clear_if_nothing_recorded(out)
        existing = sorted(p.name for p in out.glob("manifest*.json"))
        parts = sorted(p.name for p in out.iterdir() if p.is_dir() and any(p.glob("rank-*.*")))
        if name in existing:
            return f"{out} already holds a recording ({name})"
        if node is None and (existing or parts):
            return f"{out} already holds a recording ({', '.join((existing + parts)[:3])})"
    body = {"format_version": FORMAT_VERSION, "kind": RECORDING_KIND, "status": "starting", "node": node,
            "started_at": time.time(), "written_at": time.time()}
    if add:
        if not (out / name).exists():
            create_exclusive(out / name, json.dumps(body, indent=2, sort_keys=True))
        return None
    if not create_exclusive(out / name, json.dumps(body, indent=2, sort_keys=True)):
        return f"{out} already holds a recording ({name}, written just now by another command)"
    return None


# What a finished command that recorded nothing leaves: its manifest (and signature), the
# launcher's session reports and the copy of its stdin.
_EMPTY_RECORDING_FILES = ("manifest.json", "manifest.json.sig", STDIN_COPY)


def _clear_if_nothing_recorded(out: Path) -> bool:
    """Remove a finished recording that holds nothing (no part, no rank file): the summary of
    such a run tells the user to record again with --step, and the same --out must then be
    usable. Anything else in the directory, or a manifest that is not a finished single-node
    one with no parts, keeps it as it is."""
    try:
        names = {p.name for p in out.iterdir()}
        if "manifest.json" not in names or any(not (n in _EMPTY_RECORDING_FILES or (n.startswith("session-") and n.endswith(".json")))
                                               for n in names):
            return False
        body = read_manifests(out)[0]
    except (OSError, ValueError, IndexError):
        return False
    if body.get("kind") != RECORDING_KIND or body.get("status") != "complete" or body.get("parts") or body.get("still_live"):
        return False
    for n in names:
        (out / n).unlink(missing_ok=True)
    return True


def read_manifests(recording: Path) -> list[dict[str, Any]]:
    """Every manifest file of a recording (node 0's first); unreadable ones raise ValueError."""
    out = []
    for p in sorted(recording.glob("manifest*.json"), key=lambda p: (p.name != "manifest.json", p.name)):
        try:
            # Only a regular file, read with a bound: a manifest that is a link to /dev/zero or a
            # FIFO must neither fill memory nor block.
            # O_NOFOLLOW: the writer never writes links, and one could name any JSON file of the user's.
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{p.name} is not a regular file")
                raw = fh.read(_MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{p.name} is a symbolic link, not a manifest") from None
            raise ValueError(f"{p.name} cannot be read ({e.strerror or e.__class__.__name__})") from None
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"{p.name} is implausibly large")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{p.name} is not valid JSON ({e.__class__.__name__})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p.name} is not a JSON object")
        out.append(data)
    return out


def command_line() -> list[str]:
    return [sys.executable, *sys.argv]
