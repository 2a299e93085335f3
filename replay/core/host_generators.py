"""Random generators of the host a target holds beside its torch ones: a sampler's
``numpy.random.Generator`` (``np.random.default_rng(seed)``), a legacy ``RandomState``, a
``random.Random``.

A keyframe keeps what a program draws from next. The step's RNG record holds the process-wide
sources (torch's default generator, numpy's and ``random``'s global state); a generator object
the program made and holds is its own source, and a re-run that does not set it back draws other
numbers from it: a deterministic program then looks nondeterministic. Its state is data: numbers,
names and arrays, kept here as JSON bytes in a uint8 tensor (keyframes hold tensors), read back
with numbers and arrays only (no code).
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch

__all__ = ["is_host_generator", "host_generator_state", "set_host_generator_state"]

_KIND = "__kind__"
# Dtypes a bit generator's state holds (MT19937's key, Philox's counter and buffer, ...).
_ARRAY_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64", "int32", "int64", "float64"})


def is_host_generator(v: Any) -> bool:
    return isinstance(v, (np.random.Generator, np.random.RandomState, random.Random))


def _kind(g: Any) -> str:
    if isinstance(g, np.random.Generator):
        return "numpy.Generator"
    return "numpy.RandomState" if isinstance(g, np.random.RandomState) else "random.Random"


def _state(g: Any) -> Any:
    if isinstance(g, np.random.Generator):
        state = g.bit_generator.state
    elif isinstance(g, np.random.RandomState):
        state = g.get_state(legacy=False)
    else:
        state = g.getstate()  # SystemRandom raises: it has none
    return {_KIND: _kind(g), "state": state}


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"__array__": v.dtype.name, "values": v.tolist()}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return {"__tuple__": [_plain(x) for x in v]}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"a generator state holds a {type(v).__name__}")


def _from_plain(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"__array__", "values"}:
            if v["__array__"] not in _ARRAY_DTYPES:
                raise ValueError(f"array of {v['__array__']!r}")
            return np.asarray(v["values"], dtype=v["__array__"])
        if set(v) == {"__tuple__"}:
            return tuple(_from_plain(x) for x in v["__tuple__"])
        return {k: _from_plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_plain(x) for x in v]
    return v


def host_generator_state(g: Any) -> torch.Tensor:
    """The generator's state as a uint8 tensor (JSON bytes); raises where it has none."""
    raw = json.dumps(_plain(_state(g)), separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_host_generator_state(g: Any, recorded: torch.Tensor) -> None:
    """Set ``g`` back to a state ``host_generator_state`` took of a generator of the same kind;
    raises (ValueError, TypeError) on another kind or a state it does not take."""
    data = _from_plain(json.loads(bytes(recorded.to("cpu", torch.uint8).numpy().tobytes()).decode()))
    if not isinstance(data, dict) or data.get(_KIND) != _kind(g):
        raise ValueError("the recorded state is of another kind of generator")
    state = data["state"]
    if isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    else:
        g.setstate(state)

