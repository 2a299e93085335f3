"""The recorded program's environment variables, as names and digests of their values.

A re-launched program (``replay step`` with no factory) gets the environment of the shell that
runs ``replay step``, not the recorded one: a program that reads ``LORA=1`` or ``TEMP=0.5`` then
computes something else, and the re-run departs for a reason no recorded tensor shows. The
recording keeps each variable's name and a digest of its value, never the value (recordings are
handed from person to person, and values hold secrets; names that look like secrets are left
out altogether), so that a re-run can name the variables that differ.
"""

from __future__ import annotations

import hashlib
import re
from typing import Mapping

__all__ = ["env_digests", "env_differences", "recorded_env_differences"]

_SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE", re.IGNORECASE)
# replay's own variables (and its test suite's), not all of REPLAY_: a program's own REPLAY_BUG is
# the program's setting, and a difference in it is named.
_OWN = (r"REPLAY_(RECORD|RERUN|RECORDINGS$|TRUSTED_RECORDINGS$|KEY_FILE$|PERMISSIONS$|DEBUG$|LOG_LEVEL$|PROGRESS$|"
        r"KEEP_GRAPH_DOT$|DRAIN_|KILL_|FAULT_|FUZZ_|EVIL_)")
# Set by a shell, a terminal or replay itself, or per launch: they differ between two shells of
# the same user without changing what a program computes.
_NOISE = re.compile(r"^(" + _OWN + r"|PYTHONPATH$|PWD$|OLDPWD$|SHLVL$|_$|TERM|SSH_|DISPLAY$|TMUX|LS_COLORS$|PS[1-4]$|"
                    r"PROMPT_COMMAND$|HIST|COLUMNS$|LINES$|XDG_|DBUS_|WINDOWID$|COLORTERM$|MAIL|PYTEST_|COV_|"
                    r"RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|MASTER_ADDR$|MASTER_PORT$|GROUP_RANK$|GROUP_WORLD_SIZE$|"
                    r"TORCH_NCCL_ASYNC_ERROR_HANDLING$|ROLE_|TORCHELASTIC_|OMP_NUM_THREADS$|VSCODE_|GIT_|LESS|PAGER$|EDITOR$|PYENV_|HOSTNAME$|CONDA_PROMPT|"
                    # caches torch sets in its own process (torch.compile): where, not what, it computes
                    r"TORCHINDUCTOR_CACHE_DIR$|TRITON_CACHE_DIR$|TRITON_PTXAS_PATH$|TRITON_LIBDEVICE_PATH$|TORCH_WARM_POOL$|"
                    # torch's own, set inside the process (inductor's, once it compiles): not the user's to set
                    r"_TORCH)")
_MAX = 512  # variables kept: a larger environment keeps its first ones by name


def _kept(name: str) -> bool:
    return not _SECRET.search(name) and not _NOISE.match(name)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def env_digests(env: Mapping[str, str]) -> dict[str, str]:
    """``{name: digest of its value}`` for the variables a re-run compares."""
    return {k: _digest(env[k]) for k in sorted(k for k in env if _kept(k))[:_MAX]}


def env_differences(recorded: object, env: Mapping[str, str]) -> list[str]:
    """The variables set otherwise in ``env`` than in the recorded program: ``"LORA (set when
    recorded, not set here)"``; [] when the recording has no digests (an older one)."""
    if not isinstance(recorded, dict):
        return []
    out = []
    for name, a, b in _differing(recorded, env_digests(env)):
        what = "not set here" if b is None else "not set when recorded" if a is None else "another value here"
        out.append(f"{name} ({what})")
    return out


def _differing(a: dict, b: dict) -> list[tuple[str, str | None, str | None]]:
    """The variables whose digests differ between two sets, each with its digest on either side
    (None: not set); not one that a side lacks only because it kept its first ``_MAX``."""
    out = []
    for name in sorted(set(a) | set(b)):
        if not isinstance(name, str) or not _kept(name):
            continue
        va, vb = a.get(name), b.get(name)
        if va == vb or (va is None and len(a) >= _MAX) or (vb is None and len(b) >= _MAX):
            continue
        out.append((name, va, vb))
    return out


def recorded_env_differences(a: object, b: object) -> list[tuple[str, str, str]]:
    """Two recordings' variables that differ, as ``(name, in A, in B)`` ("set", "not set", or
    "a value" / "another value": values are never kept, only their digests); [] when either
    recording kept none (an older one)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or not a or not b:
        return []
    return [(name, "a value", "another value") if va is not None and vb is not None else
            (name, "set" if va is not None else "not set", "set" if vb is not None else "not set")
            for name, va, vb in _differing(a, b)]
