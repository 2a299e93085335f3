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
_JSON_ATTRS = ("config", "env", "versions", "recorder", "gpus", "numerics", "target", "record_ring")

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


# The most bytes one attribute may claim: the largest we write (the target's JSON) is far less.
_MAX_ATTR_BYTES = 16 << 20


def _attr_size_ok(f: h5py.File, name: str) -> bool:
    """True when attribute ``name`` claims a size worth reading (checked before it is read)."""
    try:
        aid = h5py.h5a.open(f.id, name.encode("utf-8"))
        n = 1
        for d in aid.shape or ():
            n *= int(d)
        return n * max(int(aid.dtype.itemsize), 1) <= _MAX_ATTR_BYTES
    except (OSError, TypeError, ValueError, KeyError, RuntimeError):
        return False


def _attrs(f: h5py.File) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in list(f.attrs):
        if not _attr_size_ok(f, k):
            continue  # claims more than any attribute we write: not ours, and not worth memory
        try:
            v = _plain(f.attrs[k])
        except (OSError, TypeError, ValueError, KeyError, RuntimeError):
            continue  # an attribute h5py cannot read (odd type, damaged): not one we wrote
        if k in _JSON_ATTRS and isinstance(v, str):
            try:
                v = json.loads(v)
            except RecursionError:
                # Nested deeper than Python decodes: not one we wrote, and kept as text it would
                # fail every later decode of it the same way (an internal error, found by the fuzz).
                continue
            except ValueError:
                pass
        out[k] = v
    return out


def _check_header(f: h5py.File, path: Path) -> dict[str, Any]:
    attrs = _attrs(f)
    if attrs.get("kind") != RANK_FILE_KIND:
        raise ValueError(f"{path.name} is an HDF5 file but not a replay rank file")
    return attrs


def _open(path: Path) -> h5py.File:
    # h5py would block forever opening a FIFO, and read a device: only regular files. A link
    # out of the part directory is not what the writer writes either.
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{path.name} is a symbolic link, not a rank file")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return h5py.File(path, "r")


# What the writer stores, and nothing else is read: datasets inside the file (contiguous or
# chunked; never external raw storage, which could name /proc/self/environ, nor a virtual
# dataset, which maps other files), reached by hard links only (an external link names another
# file, a soft link another place), with the filters the writer uses.
_TABLE_FILTERS = frozenset({h5py.h5z.FILTER_FLETCHER32})
_STRING_FILTERS = frozenset({h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32})
_LAYOUTS = frozenset({h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED})
# Fixed-length string tables are gzip-compressed padding: they may expand this much, no more.
_MAX_EXPANSION = 1100  # deflate cannot do better than about 1032:1


def _dataset(f: h5py.File, name: str) -> h5py.Dataset | None:
    """``/name`` if it is a dataset reached by a hard link; None if absent. Links are checked
    before anything is opened through them: following an external link opens another file."""
    key = name.encode()
    if not f.id.links.exists(key):
        return None
    kind = f.id.links.get_info(key).type
    if kind == h5py.h5l.TYPE_SOFT:
        raise ValueError(f"/{name} is a soft link (the writer never writes links)")
    if kind != h5py.h5l.TYPE_HARD:
        raise ValueError(f"/{name} is an external link to another file (the writer never writes links)")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise ValueError(f"table /{name} is not a dataset")
    return ds


def _check_storage(ds: h5py.Dataset, name: str, filters: frozenset[int], stored_limit: int) -> int:
    """Refuse what the writer never writes; the bytes reading ``ds`` would allocate.

    ``stored_limit``: the bytes the file really holds on disk. A dataset is read only if what
    it claims is backed by storage allocated in the file (``get_storage_size``), and that
    storage by blocks on disk: a sparse file (kilobytes on disk, gigabytes apparent) is refused
    at once, not read.
    """
    if ds.is_virtual:
        raise ValueError(f"/{name} is a virtual dataset (it maps other files; the writer never writes one)")
    if ds.external:
        raise ValueError(f"/{name} has external storage in {ds.external[0][0]!r} (the writer keeps tables inside the file)")
    dcpl = ds.id.get_create_plist()
    if dcpl.get_layout() not in _LAYOUTS:
        raise ValueError(f"/{name} has a storage layout the writer never uses")
    used = {dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())}
    if not used <= filters:
        raise ValueError(f"/{name} uses a filter the writer never uses ({sorted(used - filters)})")
    claimed = int(ds.shape[0]) * max(int(ds.dtype.itemsize), 1) if ds.ndim == 1 else 0
    if claimed == 0:
        return 0
    if ds.chunks:
        # The writer cuts tables into chunks of 16,384 rows: a table split into many more chunks
        # than that would cost a read per row.
        rows = int(ds.shape[0])
        n_chunks = -(-rows // max(int(ds.chunks[0]), 1))
        if n_chunks > 64 + rows // 1024:
            raise ValueError(f"/{name} is split into {n_chunks} chunks (the writer uses chunks of {_CHUNK_ROWS} rows)")
    stored = int(ds.id.get_storage_size())
    expand = _MAX_EXPANSION if h5py.h5z.FILTER_DEFLATE in used else 1
    if claimed > stored * expand or stored > stored_limit:
        raise ValueError(
            f"table /{name} claims {ds.shape[0]} rows ({claimed} bytes), more than the file holds "
            f"({min(stored, stored_limit)} bytes stored): a damaged, sparse or hostile file"
        )
    return claimed


def _stored_bytes(path: Path) -> int:
    """What the file holds on disk: its size, or its allocated blocks if fewer (a sparse file).

    A file system that compresses can hold more than its blocks say: some slack is allowed.
    """
    st = os.stat(path)
    blocks = getattr(st, "st_blocks", None)
    on_disk = st.st_size if blocks is None else min(st.st_size, 16 * blocks * 512)
    return on_disk + (1 << 20)


def read_rank_header(path: Path) -> dict[str, Any]:
    with _open(path) as f:
        return _check_header(f, path)


def _strings(f: h5py.File, name: str, limit: int, *, required: bool = True) -> list[str]:
    ds = _dataset(f, name)
    if ds is None:
        if required:
            raise ValueError(f"table /{name} is missing")
        return []
    if ds.ndim != 1:
        raise ValueError(f"table /{name} has the wrong layout")
    if ds.dtype.kind != "S" and h5py.check_string_dtype(ds.dtype) is None:
        raise ValueError(f"table /{name} is not a table of strings")
    if ds.dtype.kind != "S" and ds.shape[0] * 16 > limit:
        # Variable-length strings (files sealed before fixed-length ones) live in the global
        # heap: the entries' own size is what bounds them.
        raise ValueError(f"table /{name} claims {ds.shape[0]} entries, more than the file holds")
    _check_storage(ds, name, _STRING_FILTERS, limit)
    return [s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s) for s in ds[()]]


def _payload_size(f: h5py.File, path: Path) -> int:
    """The size /payload declares. It is the one dataset with external storage, and only in
    the rank's own payload file beside it (read directly, never through HDF5)."""
    ds = _dataset(f, "payload")
    if ds is None or ds.ndim != 1:
        return 0
    if ds.is_virtual:
        raise ValueError("/payload is a virtual dataset (it maps other files; the writer never writes one)")
    ext = ds.external
    size = int(ds.shape[0])
    if ext:
        want = path.with_suffix(".payload").name
        if len(ext) != 1 or ext[0][0] != want or int(ext[0][1]) != 0:
            raise ValueError(f"/payload is stored in {str(ext[0][0])[:100]!r}, not in its own {want}")
    elif size:
        # The writer stores a non-empty payload only externally; inside the file it would be read
        # from the wrong place.
        raise ValueError("/payload is stored inside the file (the writer keeps it in the .payload file)")
    return size


def _check_chunks(ds: h5py.Dataset) -> None:
    """Read a table chunk by chunk, only for HDF5 to check each chunk's Fletcher-32 checksum
    (a damaged chunk raises); one chunk in memory at a time. A table stored unchunked has no
    checksum to check (the writer never stores one so)."""
    if not ds.chunks or not ds.shape[0]:
        return
    rows, step = int(ds.shape[0]), max(int(ds.chunks[0]), 1)
    buf = np.empty(min(step, rows), dtype=ds.dtype)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        ds.read_direct(buf, source_sel=np.s_[start : start + n], dest_sel=np.s_[0:n])


def read_rank_file(path: Path, *, tables: tuple[str, ...] | None = None) -> RankTables:
    """Read a sealed rank file. ``tables`` limits which tables are loaded (the rest are empty)."""
    with _open(path) as f:
        # Every table must be backed by bytes the file really stores: one that claims more is
        # damaged or hostile, and reading it could allocate without bound.
        limit = _stored_bytes(path)
        attrs = _check_header(f, path)
        version = attrs.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"{path.name} has no valid format_version attribute")
        if version > FORMAT_VERSION:
            # Raised before any table is read, so a newer layout is never misread.
            raise _VersionError(version)
        loaded: dict[str, np.ndarray] = {}
        budget = limit
        for name, dtype in TABLES.items():
            # A table left out is still opened and its checksums checked (its object header on
            # opening, its chunks by reading them): every command that opens a rank file then
            # finds the damage a re-run's full read finds, not only the one that reads it all.
            ds, stored = _table(f, name, limit)
            budget -= stored
            if budget < 0:
                raise ValueError(f"the tables of {path.name} claim more bytes than the file holds")
            if tables is not None and name not in tables:
                _check_chunks(ds)
                loaded[name] = np.zeros(0, dtype=dtype)
                continue
            loaded[name] = ds[()]
        strings = _strings(f, "strings", limit)
        events = _strings(f, "events", limit, required=False)
        payload_size = _payload_size(f, path)
    t = RankTables(attrs=attrs, strings=strings, events=events, payload_size=payload_size, **loaded)
    check_payload_bounds(t)
    return t


def read_table(path: Path, name: str) -> np.ndarray:
    """One table of a sealed rank file, with ``read_rank_file``'s checks of it (a comparison that
    needs one large table, the collectives, without the others)."""
    with _open(path) as f:
        limit = _stored_bytes(path)
        _check_header(f, path)
        return _table(f, name, limit)[0][()]


def _table(f: h5py.File, name: str, limit: int) -> tuple[h5py.Dataset, int]:
    """Table ``name`` checked for presence, layout and storage; with the bytes it stores."""
    ds = _dataset(f, name)
    if ds is None:
        raise ValueError(f"table /{name} is missing")
    if ds.dtype != TABLES[name] or ds.ndim != 1:
        raise ValueError(f"table /{name} has the wrong layout")
    return ds, _check_storage(ds, name, _TABLE_FILTERS, limit)


class _VersionError(ValueError):
    def __init__(self, version: object) -> None:
        super().__init__(version)
        self.version = version


def payload_file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
