"""Rank tables: the in-memory form of one rank's recording.

Both the sealed HDF5 file and a live (or crashed) journal are read into the same ``RankTables``,
so every reader sees one model whatever state the recording is in. ``TablesBuilder`` is also what
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

__all__ = ["RankTables", "TablesBuilder", "build_tables", "combine_digests", "StringTable"]



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


class _Rows:
    """Rows of one table, turned into numpy chunks as they come.

    A Python tuple per row costs ten times its numpy row: sealing a long run must not hold
    every row as Python objects at once.
    """

    CHUNK = 4096

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self._chunks: list[np.ndarray] = []
        self._rows: list[tuple] = []
        self._n = 0

    def append(self, row: tuple) -> None:
        self._rows.append(row)
        self._n += 1
        if len(self._rows) >= self.CHUNK:
            self._flush()

    def __len__(self) -> int:
        return self._n

    def _flush(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            self._chunks.append(np.array(rows, dtype=self.dtype))

    def array(self) -> np.ndarray:
        self._flush()
        if not self._chunks:
            return np.zeros(0, dtype=self.dtype)
        return self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)


class _Builder:
    def __init__(self) -> None:
        self.s = StringTable()
        self.steps = _Rows(STEP_DTYPE)
        self.fields = _Rows(FIELD_DTYPE)
        self.tensors = _Rows(TENSOR_DTYPE)
        self.graphs = _Rows(GRAPH_DTYPE)
        self.kernels = _Rows(KERNEL_DTYPE)
        self.replays = _Rows(REPLAY_DTYPE)
        self.collectives = _Rows(COLLECTIVE_DTYPE)
        self.keyframes = _Rows(KEYFRAME_DTYPE)
        self.tuner = _Rows(TUNER_DTYPE)
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

    def _step_tensors(self, step: int, kind: TensorKind, records: list[dict], prefix: str | None,
                      field_digests: list[tuple[str, int]]) -> list[int]:
        """Store a step's tensors of one kind; their digests (also as fields under ``prefix``)."""
        digests = [_digest_of(r) for r in records]
        for r in records:
            self.tensor(step, kind, r)
            if prefix is not None:
                field_digests.append((f"{prefix}.{r['name']}", _digest_of(r)))
        return digests

    def _step_collectives(self, step: int, b: dict, field_digests: list[tuple[str, int]]) -> int:
        n_coll = 0
        for c in b.get("collectives", []):
            out, compare = self.collective(step, c)
            if compare:
                # Named by its place in the step, not its run-wide ordinal: the names then
                # repeat every step and the string table stays small.
                field_digests.append((f"collective.{n_coll}.{c['op']}", out))
            n_coll += 1
        return n_coll

    def step(self, b: dict) -> None:
        step = int(b["step"])
        field_digests: list[tuple[str, int]] = []
        inputs = self._step_tensors(step, TensorKind.INPUT, b.get("inputs", []), "input", field_digests)
        run = b.get("run") or {}
        mode = {"graph": RunMode.GRAPH, "eager": RunMode.EAGER}.get(run.get("mode", ""), RunMode.UNKNOWN)
        key = str(run.get("key", "")) if mode == RunMode.GRAPH else ""
        if mode != RunMode.UNKNOWN:
            field_digests.append(("graph", digest_bytes(f"{run.get('mode')}:{key}:{run.get('padded', -1)}".encode())))
        replayed = [int(g) for g in b.get("replays", [])]
        for i, g in enumerate(replayed):
            self.replays.append((step, i, g))
        n_coll = self._step_collectives(step, b, field_digests)
        outputs = self._step_tensors(step, TensorKind.OUTPUT, b.get("outputs", []), "output", field_digests)
        tokens = self._step_tensors(step, TensorKind.TOKENS, b.get("tokens", []), "tokens", field_digests)
        rng = self._step_tensors(step, TensorKind.RNG, b.get("rng", []), None, field_digests)
        for order, (name, dig) in enumerate(field_digests):
            self.fields.append((step, order, self.s(name), dig))
        self._step_row(step, b, run, mode, key, replayed, n_coll, (inputs, outputs, tokens, rng))

    def _step_row(self, step: int, b: dict, run: dict, mode: RunMode, key: str, replayed: list[int], n_coll: int,
                  digests: tuple[list[int], list[int], list[int], list[int]]) -> None:
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
                *(combine_digests(d) for d in digests),
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


class TablesBuilder:
    """Builds a rank's tables one frame at a time (``add``), then ``finish``: a journal of any
    length is sealed without holding all its frames in memory."""

    def __init__(self) -> None:
        self._attrs: dict[str, Any] | None = None
        self._b = _Builder()
        self._closed: dict | None = None
        self._first = True

    def add(self, f: Frame) -> None:
        """Take one frame; raise ValueError on a frame that is not well formed."""
        if self._first:
            self._first = False
            if f.kind != FrameKind.HEADER:
                raise ValueError("journal does not start with a header frame")
            self._attrs = dict(f.body)
            return
        if f.kind == FrameKind.CLOSE:
            self._closed = f.body
            return
        try:
            self._b.add(f)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise ValueError(f"malformed {f.kind.name.lower()} frame at byte {f.offset}: {e}") from None

    def finish(self, *, payload_size: int) -> RankTables:
        """The tables of every frame added. No frames at all is a rank killed before it wrote its
        header: empty tables, not an error, so that one such rank never makes the rest of a
        recording unreadable."""
        if self._attrs is None:
            return _empty_tables({"complete": False, "no_header": True}, payload_size)
        attrs, b, closed = self._attrs, self._b, self._closed
        if b.target is not None:
            attrs["target"] = b.target
        attrs["complete"] = closed is not None
        if closed is not None:
            attrs["ended_at"] = closed.get("ended_at")
            attrs["end_status"] = str(closed.get("status", "ok"))
            if isinstance(closed.get("uncaught"), str):
                attrs["uncaught"] = closed["uncaught"]  # the error the program ended on
            if isinstance(closed.get("ring"), dict):
                attrs["record_ring"] = closed["ring"]  # issue 15: waits for room, dropped steps
            if attrs["end_status"] == "stopped":
                # The recorder switched itself off (size limit, full disk, a writer error) and
                # said so: the file is whole, but the steps the program ran afterwards were not
                # recorded.
                attrs["complete"] = False
                attrs["stopped"] = str(closed.get("error") or "recording stopped")
        try:
            tables = RankTables(
                attrs=attrs,
                strings=b.s.strings,
                steps=b.steps.array(),
                fields=b.fields.array(),
                tensors=b.tensors.array(),
                graphs=b.graphs.array(),
                kernels=b.kernels.array(),
                replays=b.replays.array(),
                collectives=b.collectives.array(),
                keyframes=b.keyframes.array(),
                tuner=b.tuner.array(),
                events=b.events,
                payload_size=payload_size,
            )
        except (OverflowError, TypeError, ValueError) as e:
            # A number that does not fit its column (a damaged or hostile frame).
            raise ValueError(f"a frame holds a value that does not fit its table ({e})") from None
        check_payload_bounds(tables)
        return tables


def build_tables(frames: Iterable[Frame], *, payload_size: int) -> RankTables:
    """Turn a journal's frames into tables; raise ValueError on a frame that is not well formed."""
    builder = TablesBuilder()
    try:
        for f in frames:
            builder.add(f)
    except (OverflowError, TypeError) as e:
        # A chunk of rows turned into numpy while adding: a value that does not fit its column.
        raise ValueError(f"a frame holds a value that does not fit its table ({e})") from None
    return builder.finish(payload_size=payload_size)


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
    """The tables are consistent: every stored tensor lies inside the payload, every string id
    names a string, every step column names a step near the recorded ones.

    What a damaged or hostile file would otherwise hand to every reader (an id that indexes past
    the string table, a step of 2**62 that a plot tries to draw) is refused here, once, as
    damage (``ValueError``).
    """
    _check_stored_tensors(t)
    _check_string_ids(t)
    _check_steps(t)
    _check_tensor_ids(t)


def _check_stored_tensors(t: RankTables) -> None:
    stored = t.tensors[t.tensors["offset"] >= 0]
    if not stored.size:
        return
    # Each bound on its own: offset + nbytes could wrap around in int64.
    if (int(stored["nbytes"].min()) < 0 or int(stored["offset"].max()) > t.payload_size
            or int(stored["nbytes"].max()) > t.payload_size
            or int((stored["offset"] + stored["nbytes"]).max()) > t.payload_size):
        raise ValueError("a tensor lies beyond the end of the payload file")


def _check_string_ids(t: RankTables) -> None:
    n_strings = len(t.strings)
    for table, columns in _STRING_COLUMNS.items():
        rows = getattr(t, table)
        for col in columns:
            if rows.size and (int(rows[col].min()) < -1 or int(rows[col].max()) >= n_strings):
                raise ValueError(f"table /{table}: column {col} names a string that is not in /strings")


def _check_steps(t: RankTables) -> None:
    steps = t.steps["step"]
    if steps.size and int(steps.min()) < 0:
        raise ValueError("table /steps: a negative step")
    # Events outside a step carry -1; a keyframe, graph or tuner choice can belong to the step
    # that was about to run when the rank stopped: one past the last.
    hi = int(steps.max()) + 1 if steps.size else 0
    for table in ("fields", "tensors", "graphs", "replays", "collectives", "keyframes", "tuner"):
        col = getattr(t, table)["step"]
        if col.size and (int(col.min()) < -1 or int(col.max()) > hi):
            raise ValueError(f"table /{table}: a step outside the recorded steps (0..{hi - 1})")


def _check_tensor_ids(t: RankTables) -> None:
    n = t.tensors.size
    out = t.collectives["out_tensor"]
    if out.size and n and (int(out.min()) < -1 or int(out.max()) >= n):
        raise ValueError("table /collectives: column out_tensor points outside /tensors")
    k = t.keyframes
    if k.size and n and (int(k["first_tensor"].min()) < 0 or int(k["n_tensors"].min()) < 0
                         or int((k["first_tensor"] + k["n_tensors"]).max()) > n):
        raise ValueError("table /keyframes: a keyframe points outside /tensors")


# The columns holding ids into /strings (-1: none).
_STRING_COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": ("graph_key", "reason", "args"),
    "fields": ("field",),
    "tensors": ("name", "dtype"),
    "graphs": ("key", "source"),
    "kernels": ("name",),
    "collectives": ("op", "group", "shapes", "dtypes"),
    "tuner": ("op", "tactic"),
}
