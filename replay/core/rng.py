"""Capture and restore the random number generators a step may draw from.

Each generator's state is a uint8 tensor, so it is stored like any other recorded tensor (exact
bytes, deduplicated by digest) and never as a pickled Python object.
"""

from __future__ import annotations

import array
import os
import random
import struct
import sys
from typing import Callable

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]

_NP_HEAD = struct.Struct("<iid")  # pos, has_gauss, cached_gaussian


_CUDA_READERS: tuple[tuple[str, Callable[[], torch.Tensor]], ...] = ()


def _cuda_state_readers() -> tuple[tuple[str, Callable[[], torch.Tensor]], ...]:
    """(name, ``get_state``) of each CUDA device's default generator; none before CUDA is
    initialised. Made once: this runs before every recorded step is queued, where each µs of
    the host's delays the device (the generators are fixed once CUDA is initialised)."""
    global _CUDA_READERS
    if not _CUDA_READERS and torch.cuda.is_initialized():  # a flag; initialised implies available
        _CUDA_READERS = tuple((f"cuda:{i}", gen.get_state) for i, gen in enumerate(torch.cuda.default_generators))
    return _CUDA_READERS


def _forget_cuda_readers() -> None:
    # A forked child of a process that used CUDA cannot use it (torch marks CUDA uninitialised
    # there): reading its parent's generators would fail, so it asks again.
    global _CUDA_READERS
    _CUDA_READERS = ()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_cuda_readers)


def capture_rng(*, host: bool = True) -> dict[str, torch.Tensor]:
    """torch CPU, each initialised CUDA device (seed and Philox offset), and with ``host`` also
    Python's and NumPy's global generators (reading those costs ~0.1 ms, so the recorder takes
    them at keyframes; torch's are cheap and taken every step)."""
    out = {"torch_cpu": torch.default_generator.get_state()}  # what torch.get_rng_state() returns
    for name, read in _cuda_state_readers():
        # 16 bytes: seed and offset. Reading them does not synchronise the device.
        out[name] = read()
    if not host:
        return out
    version, internal, gauss = random.getstate()
    # array.array converts the 625-int tuple an order of magnitude faster than numpy does.
    words = array.array("I", internal)
    words.append(version)
    words.append(gauss is not None)
    out["python"] = torch.frombuffer(bytearray(words.tobytes()), dtype=torch.uint8)
    if gauss is not None:
        out["python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    if "numpy" in sys.modules:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if name == "MT19937":
            head = np.frombuffer(_NP_HEAD.pack(int(pos), int(has_gauss), float(cached)), dtype=np.uint8)
            out["numpy"] = torch.from_numpy(np.concatenate([keys.astype(np.uint32, copy=False).view(np.uint8), head]))
    return out


def restore_rng(states: dict[str, torch.Tensor]) -> list[str]:
    """Restore what ``capture_rng`` captured; return the generators that were restored."""
    done = []
    if "torch_cpu" in states:
        torch.set_rng_state(states["torch_cpu"].to(torch.uint8))
        done.append("torch_cpu")
    for name, t in states.items():
        if name.startswith("cuda:") and torch.cuda.is_available():
            idx = int(name.split(":")[1])
            if idx < torch.cuda.device_count():
                torch.cuda.default_generators[idx].set_state(t.to(torch.uint8))
                done.append(name)
    if "python" in states:
        words = states["python"].numpy().view(np.uint32)
        internal, (version, has_gauss) = words[:-2], words[-2:]
        gauss = float(states["python_gauss"][0]) if has_gauss and "python_gauss" in states else None
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        done.append("python")
    if "numpy" in states:
        raw = states["numpy"].numpy()
        keys = raw[: 624 * 4].view(np.uint32)
        pos, has_gauss, cached = _NP_HEAD.unpack(raw[624 * 4 :].tobytes())
        np.random.set_state(("MT19937", keys, pos, has_gauss, cached))
        done.append("numpy")
    return done
