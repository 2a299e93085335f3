"""The recording schema, format version 1: file names, table layouts and the codecs they share.

A recording is a directory::

    <recording>/manifest.json            run-level facts (command, hosts, versions, parts)
    <recording>/<part>/rank-00003.h5      one sealed rank file: tables and attributes
    <recording>/<part>/rank-00003.payload raw tensor bytes, referenced by the .h5 file
    <recording>/<part>/rank-00003.journal while recording (or after a crash, until sealed)

``docs/format.md`` is the user-facing description; this module is the one the code follows.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import numpy as np
from typing import TYPE_CHECKING

from replay._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

__all__ = [
    "FORMAT_VERSION",
    "RANK_FILE_KIND",
    "TensorKind",
    "StepStatus",
    "RunMode",
    "STEP_DTYPE",
    "FIELD_DTYPE",
    "TENSOR_DTYPE",
    "GRAPH_DTYPE",
    "KERNEL_DTYPE",
    "REPLAY_DTYPE",
    "COLLECTIVE_DTYPE",
    "KEYFRAME_DTYPE",
    "TUNER_DTYPE",
    "MAX_NDIM",
    "rank_stem",
    "parse_rank_stem",
    "dtype_to_str",
    "str_to_dtype",
    "TensorRef",
]

FORMAT_VERSION = 1
RANK_FILE_KIND = "replay-rank"
MAX_NDIM = 8

_RANK_RE = re.compile(r"^rank-(\d{5,})$")


def rank_stem(rank: int) -> str:
    """``rank-00003``: global ranks, zero-padded so a directory listing sorts by rank."""
    return f"rank-{rank:05d}"


def parse_rank_stem(stem: str) -> int | None:
    m = _RANK_RE.match(stem)
    return int(m.group(1)) if m else None


class TensorKind(enum.IntEnum):
    INPUT = 0
    OUTPUT = 1
    TOKENS = 2
    STATE = 3
    LOGITS = 4
    COLLECTIVE = 5
    RNG = 6


class StepStatus(enum.IntEnum):
    OK = 0
    RAISED = 1


class RunMode(enum.IntEnum):
    UNKNOWN = 0
    EAGER = 1
    GRAPH = 2


# Digests are uint64. Strings are ids into the file's one string table (/strings), so the tables
# stay fixed-size and a scan of /steps never touches variable-length data.
STEP_DTYPE = np.dtype(
    [
        ("step", "<i8"),
        ("t_begin", "<f8"),
        ("t_end", "<f8"),
        ("status", "u1"),
        ("mode", "u1"),
        ("graph", "<i4"),  # id into /graphs, -1 when no graph replayed
        ("graph_key", "<i4"),  # string id, -1 when eager
        ("padded_size", "<i4"),
        ("reason", "<i4"),  # string id: why the step ran eagerly, or the error it raised
        ("margin", "<f4"),  # min top-1/top-2 logit margin over the step's rows; NaN if unknown
        ("accepted", "<i8"),  # total accepted tokens in the step, -1 if unknown
        ("n_collectives", "<i4"),
        ("args", "<i4"),  # string id: the step's non-tensor arguments as JSON, -1 if none
        ("input_digest", "<u8"),
        ("output_digest", "<u8"),
        ("token_digest", "<u8"),
        ("rng_digest", "<u8"),
    ]
)

# One row per compared field of a step, in the order the program produced them
# (inputs, graph, collectives, outputs, tokens): the unit of the first-divergence search.
FIELD_DTYPE = np.dtype([("step", "<i8"), ("order", "<i4"), ("field", "<i4"), ("digest", "<u8")])

TENSOR_DTYPE = np.dtype(
    [
        ("step", "<i8"),  # -1 when outside a step
        ("kind", "u1"),
        ("name", "<i4"),
        ("dtype", "<i4"),
        ("ndim", "u1"),
        ("shape", "<i8", (MAX_NDIM,)),
        ("offset", "<i8"),  # byte offset into the payload, -1 when only the digest was kept
        ("nbytes", "<i8"),
        ("digest", "<u8"),
    ]
)

GRAPH_DTYPE = np.dtype(
    [
        ("graph", "<i4"),
        ("key", "<i4"),
        ("padded_size", "<i4"),
        ("pool", "<i8"),
        ("step", "<i8"),  # the step during or before which it was captured
        ("source", "<i4"),  # string id: "torch.cuda.CUDAGraph" or the capture callable
        ("n_kernels", "<i4"),
    ]
)

KERNEL_DTYPE = np.dtype(
    [
        ("graph", "<i4"),
        ("ordinal", "<i4"),
        ("name", "<i4"),
        ("grid", "<i4", (3,)),
        ("block", "<i4", (3,)),
    ]
)

REPLAY_DTYPE = np.dtype([("step", "<i8"), ("ordinal", "<i4"), ("graph", "<i4")])

COLLECTIVE_DTYPE = np.dtype(
    [
        ("step", "<i8"),
        ("ordinal", "<i4"),  # call number on this rank, over the whole run
        ("op", "<i4"),
        ("group", "<i4"),
        ("group_size", "<i4"),
        ("shapes", "<i4"),  # string id: "[[4, 8]] -> [[32, 8]]"
        ("dtypes", "<i4"),
        ("in_digest", "<u8"),
        ("out_digest", "<u8"),
        ("out_tensor", "<i8"),  # row in /tensors holding the output in full, -1 if digest only
        ("compare", "u1"),  # 1 when every rank of the group must get the same output bits
    ]
)

KEYFRAME_DTYPE = np.dtype([("step", "<i8"), ("first_tensor", "<i8"), ("n_tensors", "<i4")])

TUNER_DTYPE = np.dtype([("step", "<i8"), ("op", "<i4"), ("tactic", "<i4")])


# The dtypes a recording may name: an allow-list, so a recording cannot make the reader build an
# arbitrary object. Checked without importing torch (readers of tables never need it).
DTYPE_NAMES = frozenset(
    "float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint8 "
    "uint16 uint32 uint64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz".split()
)


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be recorded")
    return name


def str_to_dtype(name: str) -> torch.dtype:
    """The torch dtype of a recorded name; a name outside the allow-list is rejected."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}")
    dtype = getattr(torch, name, None)
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not available in this torch")
    return dtype


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}")


@dataclass(slots=True, frozen=True)
class TensorRef:
    """A recorded tensor: its metadata, digest, and where its bytes are (if they were kept)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: int
    offset: int = -1
    nbytes: int = 0

    @property
    def stored(self) -> bool:
        return self.offset >= 0

    def to_json(self) -> dict:
        d: dict = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "dig": f"{self.digest:016x}"}
        if self.offset >= 0:
            d["off"] = self.offset
            d["n"] = self.nbytes
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TensorRef":
        shape = tuple(int(x) for x in d["shape"])
        if len(shape) > MAX_NDIM or any(x < 0 for x in shape):
            raise ValueError(f"bad shape {shape}")
        check_dtype_name(d["dtype"])
        return cls(
            name=str(d["name"]),
            dtype=str(d["dtype"]),
            shape=shape,
            digest=int(d["dig"], 16),
            offset=int(d.get("off", -1)),
            nbytes=int(d.get("n", 0)),
        )
