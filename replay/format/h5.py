"""HDF5 encoding of rank tables. With ``manifest.py`` this is the only code that touches h5py.

Layout of a sealed rank file (``h5ls -r rank-00003.h5``)::

    /                 attributes: format_version, kind, rank, world_size, part, complete, ...
    /steps            one row per step (STEP_DTYPE): the table ``replay info`` scans
    /fields           per-step field digests in program order (FIELD_DTYPE)
    /tensors          index of every recorded tensor (TENSOR_DTYPE)
    /payload          uint8, stored externally in rank-NNNNN.payload (the bytes /tensors points at)
    /graphs /kernels /replays /collectives /keyframes /tuner    event tables
    /strings          the string table every *_id column indexes
    /events           free-text notes (warnings the recorder logged)
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from replay.format.schema import (
    COLLECTIVE_DTYPE,
    FIELD_DTYPE,
    FORMAT_VERSION,
    GRAPH_DTYPE,
    KERNEL_DTYPE,
    KEYFRAME_DTYPE,
    RANK_FILE_KIND,
    REPLAY_DTYPE,
    STEP_DTYPE,
    TENSOR_DTYPE,
    TUNER_DTYPE,
)
from replay.format.tables import RankTables, check_payload_bounds

__all__ = ["write_rank_file", "read_rank_file", "read_rank_header", "TABLES"]

TABLES: dict[str, np.dtype] = {
    "steps": STEP_DTYPE,
    "fields": FIELD_DTYPE,
    "tensors": TENSOR_DTYPE,
    "graphs": GRAPH_DTYPE,
    "kernels": KERNEL_DTYPE,
    "replays": REPLAY_DTYPE,
    "collectives": COLLECTIVE_DTYPE,
    "keyframes": KEYFRAME_DTYPE,
    "tuner": TUNER_DTYPE,
}

# Attributes that are dicts are stored as JSON text: readable in h5dump, and never unpickled.
_JSON_ATTRS = ("config", "env", "versions", "recorder", "gpus", "numerics", "target")

# Rows per chunk of a table: chunked so that every table carries a Fletcher-32 checksum.
_CHUNK_ROWS = 1 << 14


def _text(v: str) -> np.bytes_:
    """A string attribute as fixed-length UTF-8: kept in the object header, which HDF5 checksums.

    Not variable-length: those live in HDF5's global heap, which has no checksum, and a damaged
    global heap can make libhdf5 loop forever on read (found by tests/test_fuzz.py).
    """
    return np.bytes_(v.encode("utf-8"))


def _string_table(f: h5py.File, name: str, strings: list[str]) -> None:
    """A list of strings as a fixed-length UTF-8 dataset (not variable-length, see ``_text``),
    compressed (the padding costs nothing) and checksummed."""
    raw = [s.encode("utf-8") for s in strings]
    width = max((len(b) for b in raw), default=1) or 1
    # (h5py cannot convert numpy bytes to a fixed-length type tagged UTF-8, so the type says
    # ASCII; the bytes are UTF-8, and readers decode them as such.)
    data = np.array(raw, dtype=f"S{width}") if raw else np.zeros(0, dtype=f"S{width}")
    f.create_dataset(
        name, data=data, chunks=(max(1, min(len(raw), _CHUNK_ROWS)),), maxshape=(None,),
        compression="gzip", compression_opts=1, shuffle=True, fletcher32=True,
    )


def write_rank_file(tables: RankTables, path: Path, payload_name: str) -> None:
    """Write ``tables`` to ``path`` (which must not exist yet); the payload stays where it is.

    Every table is chunked with a Fletcher-32 checksum, and every string is fixed-length: a byte
    changed anywhere in the file after sealing is reported as damage when it is read, never
    silently taken as data, and never sends libhdf5 into a loop.
    """
    with h5py.File(path, "w", libver="latest") as f:
        for k, v in tables.attrs.items():
            if v is None:
                continue
            if k in _JSON_ATTRS or isinstance(v, (dict, list)):
                f.attrs[k] = _text(json.dumps(v, sort_keys=True))
            elif isinstance(v, str):
                f.attrs[k] = _text(v)
            else:
                try:
                    f.attrs[k] = v
                except (TypeError, ValueError, OverflowError):
                    # A header value HDF5 has no type for (an integer beyond 64 bits, from a
                    # damaged journal): kept as JSON text rather than failing the seal.
                    f.attrs[k] = _text(json.dumps(v, default=str))
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["kind"] = _text(RANK_FILE_KIND)
        for name in TABLES:
            data = getattr(tables, name)
            f.create_dataset(
                name, data=data, chunks=(max(1, min(len(data), _CHUNK_ROWS)),), maxshape=(None,), fletcher32=True
            )
        _string_table(f, "strings", tables.strings)
        _string_table(f, "events", tables.events)
        if tables.payload_size:
            # External storage: the payload is not copied at seal time, and h5py/h5dump can still
            # read it (relative names resolve against the working directory, or against the
            # file's own directory with HDF5_EXTFILE_PREFIX='${ORIGIN}').
            f.create_dataset(
                "payload", shape=(tables.payload_size,), dtype="u1", external=[(payload_name, 0, tables.payload_size)]
            )
        else:
            f.create_dataset("payload", shape=(0,), dtype="u1")


_MAX_ATTR_ITEMS = 4096  # an array attribute longer than this is not one we wrote: dropped


def _plain(v: Any) -> Any:
    """An attribute value as a plain Python value (str, int, float, bool, list), or None."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        v = v.item()
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    if isinstance(v, np.ndarray):
        if v.size > _MAX_ATTR_ITEMS:
            return None
        return [_plain(x) for x in v.reshape(-1).tolist()]
    if isinstance(v, (str, int, float, bool)):
        return v
    return str(v)[:1000]


def _attrs(f: h5py.File) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in list(f.attrs):
        try:
            v = _plain(f.attrs[k])
        except (OSError, TypeError, ValueError, KeyError, RuntimeError):
            continue  # an attribute h5py cannot read (odd type, damaged): not one we wrote
        if k in _JSON_ATTRS and isinstance(v, str):
            try:
                v = json.loads(v)
            except (ValueError, RecursionError):
                pass
        out[k] = v
    return out


def _check_header(f: h5py.File, path: Path) -> dict[str, Any]:
    attrs = _attrs(f)
    if attrs.get("kind") != RANK_FILE_KIND:
        raise ValueError(f"{path.name} is an HDF5 file but not a replay rank file")
    return attrs


def _open(path: Path) -> h5py.File:
    # h5py would block forever opening a FIFO, and read a device: only regular files.
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return h5py.File(path, "r")


def read_rank_header(path: Path) -> dict[str, Any]:
    with _open(path) as f:
        return _check_header(f, path)


def _strings(ds: Any, name: str, limit: int) -> list[str]:
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 1:
        raise ValueError(f"table /{name} is missing")
    # Compressed padding can legitimately hold many times the file's size, but not without bound.
    if ds.shape[0] > limit or ds.shape[0] * max(ds.dtype.itemsize, 1) > 64 * limit:
        raise ValueError(f"table /{name} claims {ds.shape[0]} entries, more than the file holds")
    return [s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s) for s in ds[()]]


def read_rank_file(path: Path, *, tables: tuple[str, ...] | None = None) -> RankTables:
    """Read a sealed rank file. ``tables`` limits which tables are loaded (the rest are empty)."""
    with _open(path) as f:
        # Tables are stored contiguous and uncompressed: one that claims more bytes than the
        # file holds is damaged or hostile, and reading it could allocate without bound.
        limit = os.stat(path).st_size + (1 << 20)
        attrs = _check_header(f, path)
        version = attrs.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"{path.name} has no valid format_version attribute")
        if version > FORMAT_VERSION:
            # Raised before any table is read, so a newer layout is never misread.
            raise _VersionError(version)
        loaded: dict[str, np.ndarray] = {}
        for name, dtype in TABLES.items():
            if tables is not None and name not in tables:
                loaded[name] = np.zeros(0, dtype=dtype)
                continue
            if name not in f:
                raise ValueError(f"table /{name} is missing")
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or ds.dtype != dtype or ds.ndim != 1:
                raise ValueError(f"table /{name} has the wrong layout")
            if ds.shape[0] * dtype.itemsize > limit:
                raise ValueError(f"table /{name} claims {ds.shape[0]} rows, more than the file holds")
            loaded[name] = ds[()]
        strings = _strings(f.get("strings"), "strings", limit)
        events_ds = f.get("events")
        events = _strings(events_ds, "events", limit) if isinstance(events_ds, h5py.Dataset) else []
        payload = f.get("payload")
        payload_size = int(payload.shape[0]) if isinstance(payload, h5py.Dataset) and payload.ndim == 1 else 0
    t = RankTables(attrs=attrs, strings=strings, events=events, payload_size=payload_size, **loaded)
    check_payload_bounds(t)
    return t


class _VersionError(ValueError):
    def __init__(self, version: object) -> None:
        super().__init__(version)
        self.version = version


def payload_file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
