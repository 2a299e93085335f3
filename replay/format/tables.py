"""Rank tables: the in-memory form of one rank's recording.

Both the sealed HDF5 file and a live (or crashed) journal are read into the same ``RankTables``,
so every reader sees one model whatever state the recording is in. ``build_tables`` is also what
sealing writes to HDF5.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from replay.digest import digest_bytes
from replay.format.journal import Frame, FrameKind
from replay.format.schema import (
    COLLECTIVE_DTYPE,
    FIELD_DTYPE,
    GRAPH_DTYPE,
    KERNEL_DTYPE,
    KEYFRAME_DTYPE,
    MAX_NDIM,
    REPLAY_DTYPE,
    STEP_DTYPE,
    TENSOR_DTYPE,
    TUNER_DTYPE,
    RunMode,
    StepStatus,
    TensorKind,
    TensorRef,
)

__all__ = ["RankTables", "build_tables", "combine_digests", "StringTable"]



_M64 = 0xFFFFFFFFFFFFFFFF


def combine_digests(digests: Iterable[int]) -> int:
    """One digest for an ordered list of digests (the per-step summary columns).

    Order-sensitive (position matters) and cheap in pure Python: it runs for every step.
    """
    h = 0
    for i, d in enumerate(digests):
        h = ((h ^ (d & _M64)) * 0x100000001B3 + i + 1) & _M64
        h ^= h >> 29
    return h


class StringTable:
    def __init__(self, strings: list[str] | None = None) -> None:
        self.strings: list[str] = list(strings or [])
        self._ids = {s: i for i, s in enumerate(self.strings)}

    def __call__(self, s: str) -> int:
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def get(self, i: int) -> str:
        return self.strings[i] if 0 <= i < len(self.strings) else ""


@dataclass(slots=True)
class RankTables:
    attrs: dict[str, Any]
    strings: list[str]
    steps: np.ndarray
    fields: np.ndarray
    tensors: np.ndarray
    graphs: np.ndarray
    kernels: np.ndarray
    replays: np.ndarray
    collectives: np.ndarray
    keyframes: np.ndarray
    tuner: np.ndarray
    events: list[str] = field(default_factory=list)
    payload_size: int = 0

    def string(self, i: int) -> str:
        return self.strings[i] if 0 <= i < len(self.strings) else ""


def _digest_of(ref: dict) -> int:
    return int(ref["dig"], 16)


class _Builder:
    def __init__(self) -> None:
        self.s = StringTable()
        self.steps: list[tuple] = []
        self.fields: list[tuple] = []
        self.tensors: list[tuple] = []
        self.graphs: list[tuple] = []
        self.kernels: list[tuple] = []
        self.replays: list[tuple] = []
        self.collectives: list[tuple] = []
        self.keyframes: list[tuple] = []
        self.tuner: list[tuple] = []
        self.events: list[str] = []
        self.target: dict[str, Any] | None = None

    def tensor(self, step: int, kind: TensorKind, ref_json: dict) -> int:
        ref = TensorRef.from_json(ref_json)
        shape = list(ref.shape) + [0] * (MAX_NDIM - len(ref.shape))
        self.tensors.append(
            (step, int(kind), self.s(ref.name), self.s(ref.dtype), len(ref.shape), shape, ref.offset, ref.nbytes, ref.digest)
        )
        return len(self.tensors) - 1

    def collective(self, step: int, c: dict) -> tuple[int, bool]:
        out_row = -1
        if c.get("out_ref") is not None:
            out_row = self.tensor(step, TensorKind.COLLECTIVE, c["out_ref"])
        compare = bool(c.get("compare", False))
        self.collectives.append(
            (
                step,
                int(c["ordinal"]),
                self.s(str(c["op"])),
                self.s(str(c.get("group", ""))),
                int(c.get("group_size", 0)),
                self.s(str(c.get("shapes", ""))),
                self.s(str(c.get("dtypes", ""))),
                int(c.get("in", "0"), 16),
                int(c.get("out", "0"), 16),
                out_row,
                int(compare),
            )
        )
        return int(c.get("out", "0"), 16), compare

    def step(self, b: dict) -> None:
        step = int(b["step"])
        order = 0
        field_digests: list[tuple[str, int]] = []
        inputs = [_digest_of(r) for r in b.get("inputs", [])]
        for r in b.get("inputs", []):
            self.tensor(step, TensorKind.INPUT, r)
            field_digests.append((f"input.{r['name']}", _digest_of(r)))
        run = b.get("run") or {}
        mode = {"graph": RunMode.GRAPH, "eager": RunMode.EAGER}.get(run.get("mode", ""), RunMode.UNKNOWN)
        key = str(run.get("key", "")) if mode == RunMode.GRAPH else ""
        if mode != RunMode.UNKNOWN:
            field_digests.append(("graph", digest_bytes(f"{run.get('mode')}:{key}:{run.get('padded', -1)}".encode())))
        replayed = [int(g) for g in b.get("replays", [])]
        for i, g in enumerate(replayed):
            self.replays.append((step, i, g))
        n_coll = 0
        for c in b.get("collectives", []):
            out, compare = self.collective(step, c)
            if compare:
                # Named by its place in the step, not its run-wide ordinal: the names then
                # repeat every step and the string table stays small.
                field_digests.append((f"collective.{n_coll}.{c['op']}", out))
            n_coll += 1
        outputs = [_digest_of(r) for r in b.get("outputs", [])]
        for r in b.get("outputs", []):
            self.tensor(step, TensorKind.OUTPUT, r)
            field_digests.append((f"output.{r['name']}", _digest_of(r)))
        tokens = [_digest_of(r) for r in b.get("tokens", [])]
        for r in b.get("tokens", []):
            self.tensor(step, TensorKind.TOKENS, r)
            field_digests.append((f"tokens.{r['name']}", _digest_of(r)))
        rng = [_digest_of(r) for r in b.get("rng", [])]
        for r in b.get("rng", []):
            self.tensor(step, TensorKind.RNG, r)
        for name, dig in field_digests:
            self.fields.append((step, order, self.s(name), dig))
            order += 1
        status = StepStatus.RAISED if b.get("status") == "raised" else StepStatus.OK
        reason = str(b.get("error") or run.get("reason") or "")
        margin = b.get("margin")
        accepted = b.get("accepted")
        args = b.get("args")
        args_id = self.s(json.dumps(args, sort_keys=True)) if args else -1
        self.steps.append(
            (
                step,
                float(b.get("t0", 0.0)),
                float(b.get("t1", 0.0)),
                int(status),
                int(mode),
                replayed[-1] if replayed else -1,
                self.s(key) if key else -1,
                int(run.get("padded", -1)),
                self.s(reason) if reason else -1,
                float(margin) if margin is not None else math.nan,
                int(accepted) if accepted is not None else -1,
                n_coll,
                args_id,
                combine_digests(inputs),
                combine_digests(outputs),
                combine_digests(tokens),
                combine_digests(rng),
            )
        )

    def graph(self, b: dict) -> None:
        gid = int(b["graph"])
        kernels = b.get("kernels", [])
        self.graphs.append(
            (
                gid,
                self.s(str(b.get("key", ""))),
                int(b.get("padded", -1)),
                int(b.get("pool", -1)),
                int(b.get("step", -1)),
                self.s(str(b.get("source", ""))),
                len(kernels),
            )
        )
        for i, k in enumerate(kernels):
            grid = (list(k.get("grid", [0, 0, 0])) + [0, 0, 0])[:3]
            block = (list(k.get("block", [0, 0, 0])) + [0, 0, 0])[:3]
            self.kernels.append((gid, i, self.s(str(k["name"])), [int(x) for x in grid], [int(x) for x in block]))

    def add(self, f: Frame) -> None:
        b = f.body
        if f.kind == FrameKind.STEP:
            self.step(b)
        elif f.kind == FrameKind.GRAPH:
            self.graph(b)
        elif f.kind == FrameKind.REPLAY:
            self.replays.append((int(b.get("step", -1)), int(b.get("ordinal", 0)), int(b["graph"])))
        elif f.kind == FrameKind.COLLECTIVE:
            self.collective(int(b.get("step", -1)), b)
        elif f.kind in (FrameKind.KEYFRAME, FrameKind.LOGITS):
            step = int(b["step"])
            kind = TensorKind.STATE if f.kind == FrameKind.KEYFRAME else TensorKind.LOGITS
            refs = b.get("tensors", [])
            first = len(self.tensors)
            for r in refs:
                self.tensor(step, kind, r)
            if f.kind == FrameKind.KEYFRAME:
                self.keyframes.append((step, first, len(refs)))
        elif f.kind == FrameKind.TUNER:
            step = int(b.get("step", -1))
            for op, tactic in sorted(dict(b.get("choices", {})).items()):
                self.tuner.append((step, self.s(str(op)), self.s(str(tactic))))
        elif f.kind == FrameKind.NOTE:
            self.events.append(str(b.get("message", "")))
        elif f.kind == FrameKind.TARGET:
            self.target = dict(b)


def _array(rows: list[tuple], dtype: np.dtype) -> np.ndarray:
    return np.array(rows, dtype=dtype) if rows else np.zeros(0, dtype=dtype)


def build_tables(frames: list[Frame], *, payload_size: int) -> RankTables:
    """Turn a journal's frames into tables; raise ValueError on a frame that is not well formed.

    No frames at all is a rank killed before it wrote its header: empty tables, not an error,
    so one such rank never makes the rest of a recording unreadable.
    """
    if not frames:
        return _empty_tables({"complete": False, "no_header": True}, payload_size)
    if frames[0].kind != FrameKind.HEADER:
        raise ValueError("journal does not start with a header frame")
    attrs = dict(frames[0].body)
    b = _Builder()
    closed: dict | None = None
    for f in frames[1:]:
        if f.kind == FrameKind.CLOSE:
            closed = f.body
            continue
        try:
            b.add(f)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise ValueError(f"malformed {f.kind.name.lower()} frame at byte {f.offset}: {e}") from None
    if b.target is not None:
        attrs["target"] = b.target
    attrs["complete"] = closed is not None
    if closed is not None:
        attrs["ended_at"] = closed.get("ended_at")
        attrs["end_status"] = str(closed.get("status", "ok"))
        if attrs["end_status"] == "stopped":
            # The recorder switched itself off (size limit, full disk, a writer error) and said
            # so: the file is whole, but the steps the program ran afterwards were not recorded.
            attrs["complete"] = False
            attrs["stopped"] = str(closed.get("error") or "recording stopped")
    try:
        tables = RankTables(
            attrs=attrs,
            strings=b.s.strings,
            steps=_array(b.steps, STEP_DTYPE),
            fields=_array(b.fields, FIELD_DTYPE),
            tensors=_array(b.tensors, TENSOR_DTYPE),
            graphs=_array(b.graphs, GRAPH_DTYPE),
            kernels=_array(b.kernels, KERNEL_DTYPE),
            replays=_array(b.replays, REPLAY_DTYPE),
            collectives=_array(b.collectives, COLLECTIVE_DTYPE),
            keyframes=_array(b.keyframes, KEYFRAME_DTYPE),
            tuner=_array(b.tuner, TUNER_DTYPE),
            events=b.events,
            payload_size=payload_size,
        )
    except (OverflowError, TypeError, ValueError) as e:
        # A number that does not fit its column (a damaged or hostile frame).
        raise ValueError(f"a frame holds a value that does not fit its table ({e})") from None
    check_payload_bounds(tables)
    return tables


def _empty_tables(attrs: dict[str, Any], payload_size: int) -> RankTables:
    return RankTables(
        attrs=attrs,
        strings=[],
        steps=np.zeros(0, STEP_DTYPE),
        fields=np.zeros(0, FIELD_DTYPE),
        tensors=np.zeros(0, TENSOR_DTYPE),
        graphs=np.zeros(0, GRAPH_DTYPE),
        kernels=np.zeros(0, KERNEL_DTYPE),
        replays=np.zeros(0, REPLAY_DTYPE),
        collectives=np.zeros(0, COLLECTIVE_DTYPE),
        keyframes=np.zeros(0, KEYFRAME_DTYPE),
        tuner=np.zeros(0, TUNER_DTYPE),
        payload_size=payload_size,
    )


def check_payload_bounds(t: RankTables) -> None:
    """Every stored tensor lies inside the payload and its size matches its shape and dtype."""
    stored = t.tensors[t.tensors["offset"] >= 0]
    if stored.size:
        end = stored["offset"] + stored["nbytes"]
        if int(end.max()) > t.payload_size or int(stored["nbytes"].min()) < 0:
            raise ValueError("a tensor lies beyond the end of the payload file")
