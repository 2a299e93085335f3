"""Which model (stream) each recorded step belongs to, when one loop runs several (draft and
target, MTP head and trunk): one step sequence per stream, the order across streams kept.

A step's stream is its reserved ``__stream__`` argument; steps recorded before a second model
appeared carry none and belong to the first stream (the target info's ``stream``). Only the
distinct argument strings are parsed, so the cost does not grow with the number of steps
(``rerun.streams.stream_of`` answers the same question for one step).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from replay.format.reader import RankFile

__all__ = ["step_streams", "stream_position"]

# ``replay.numerics.STREAM_ARG``, spelled here: reading a recording (``replay info``) needs no torch.
STREAM_ARG = "__stream__"


def _first_stream(rf: RankFile) -> str | None:
    t = rf.attrs.get("target")
    if isinstance(t, str):
        try:
            t = json.loads(t)
        except (ValueError, RecursionError):  # a hostile file's JSON nested past Python's stack
            return None
    if not isinstance(t, dict) or not isinstance(t.get("streams"), dict) or len(t["streams"]) < 2:
        return None
    name = t.get("stream")
    return str(name) if isinstance(name, str) else None


def step_streams(rf: RankFile) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(step numbers, stream index per step, stream names in order of first appearance); no
    names when the recording holds one model."""
    t = rf.tables
    steps = t.steps
    first = _first_stream(rf)
    if first is None or steps.size == 0:
        return steps["step"] if steps.size else np.zeros(0, np.int64), np.zeros(steps.size, np.int64), []
    ids, inverse = np.unique(steps["args"], return_inverse=True)
    labels = []
    for sid in ids:
        name = first
        try:
            a = json.loads(t.string(int(sid))) if int(sid) >= 0 else {}
            if isinstance(a, dict) and isinstance(a.get(STREAM_ARG), str):
                name = a[STREAM_ARG]
        except ValueError:
            pass
        labels.append(name)
    per_step = np.array(labels, dtype=object)[inverse]
    names: list[str] = []
    for n in per_step:
        if n not in names:
            names.append(n)
    index = {n: i for i, n in enumerate(names)}
    return steps["step"], np.array([index[n] for n in per_step], dtype=np.int64), names


def stream_position(steps: np.ndarray, index: np.ndarray, names: list[str], step: int) -> tuple[str, int] | None:
    """(the stream of ``step``, the step's index among that stream's steps), from
    ``step_streams``' arrays, as ``replay info`` numbers them; None when the step is not there
    or the rank recorded one model."""
    at = np.flatnonzero(steps == step)
    if not names or not at.size:
        return None
    i = int(index[at[0]])
    return names[i], int(((index == i) & (steps < step)).sum())
