"""Reading recordings: a recording is a mapping of parts, a part a mapping of ranks.

Opening a recording never runs code from it: metadata is JSON or HDF5 attributes, tensors are
raw bytes whose dtype is checked against an allow-list and whose size is checked against their
shape. Every problem with the files becomes one ``RecordingDamaged`` (or ``FormatVersionError``)
line naming the file.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from typing import TYPE_CHECKING

from replay._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

from replay.digest import digest_bytes
from replay.errors import FormatVersionError, OutOfRange, RecordingDamaged, RecordingNotFound, RerunError
from replay.format import h5 as _h5
from replay.format.journal import scan_journal
from replay.format.manifest import RECORDING_KIND, read_manifests
from replay.format.schema import FORMAT_VERSION, RunMode, StepStatus, TensorKind, parse_rank_stem, str_to_dtype
from replay.format.seal import journal_is_live
from replay.format.tables import RankTables, TablesBuilder

__all__ = ["Recording", "Part", "RankFile", "StepView", "TensorDamaged", "open_recording", "find_recordings",
           "resolve_recording"]

# The most ranks a recording may declare (a larger world_size attribute is taken as damage).
MAX_WORLD_SIZE = 1 << 16

# Small tables that `info` needs; /tensors, /collectives and /replays grow with the run.
_SUMMARY_TABLES = ("steps", "fields", "graphs", "kernels", "tuner")

# Stored tensors at least this large are remembered once their digest matched (not hashed again
# when read again); smaller ones cost less to hash again than to remember, over a long re-run.
_DIGEST_REMEMBERED_BYTES = 1 << 16


class TensorDamaged(RecordingDamaged, RerunError):
    """A stored tensor that cannot be read as recorded (its bytes changed, cut off, or described
    wrongly): the recording is damaged (exit code 4).

    Also a ``RerunError``, the error a re-run stops on: a re-run reads a catch-up step's inputs
    inside the step's own call, where any other exception is taken as the step raising, and it
    would then report damage to the file as the program departing from its recording.
    """

    exit_code = RecordingDamaged.exit_code


def find_recordings(root: Path) -> list[Path]:
    """Recordings directly under ``root``, oldest first, by when they started.

    The time is the manifest's ``started_at`` (``created_at`` for a recording made by a
    ``Recorder`` alone), never the directory's name: a planted ``recordings/99999999-...`` must
    not become every command's default. A recorded time later than the manifest file's own
    change time (which a user cannot set) is not believed. Symbolic links are not followed.
    """
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        try:
            if p.is_symlink() or not p.is_dir() or not _looks_like_recording(p):
                continue
        except OSError:
            continue
        found.append((_started(p), p.name, p))
    return [p for _, _, p in sorted(found)]


def _started(p: Path) -> float:
    """When recording ``p`` started, as far as can be believed (see ``find_recordings``)."""
    m = p / "manifest.json"
    try:
        st = os.lstat(m) if m.exists() else os.lstat(p)
    except OSError:
        return 0.0
    claimed = None
    if stat.S_ISREG(st.st_mode):
        try:
            manifests = read_manifests(p)
        except ValueError:
            manifests = []
        for data in manifests[:1]:
            for key in ("started_at", "created_at"):
                v = data.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    claimed = float(v)
                    break
    if claimed is not None and claimed <= st.st_ctime + 2.0:
        return claimed
    # No start time, or one after the file was last changed (so not true): the modification
    # time, which a file's owner can set, but never later than what the system recorded.
    return min(st.st_mtime, st.st_ctime)


def _looks_like_recording(p: Path) -> bool:
    if (p / "manifest.json").exists():
        return True
    return any(_is_part_dir(c) for c in p.iterdir() if c.is_dir())


def _is_part_dir(p: Path) -> bool:
    return any(parse_rank_stem(f.stem) is not None for f in p.glob("rank-*.*"))


def resolve_recording(path: str | os.PathLike | None, root: str | os.PathLike = "recordings") -> tuple[Path, bool]:
    """The recording a command works on: ``path``, or the newest under ``root``. (path, defaulted)."""
    if path is not None:
        p = Path(path)
        if not p.exists():
            base, sep, part = str(path).rpartition(":")
            if sep and base and Path(base).is_dir() and "/" not in part:
                # ``REC:PART`` is how `replay diff` names a part; the other commands take --part.
                raise RecordingNotFound(f"no recording at {p}: to choose a part of {base}, give --part {part}")
            raise RecordingNotFound(f"no recording at {p}: give the directory `replay record` wrote")
        return p, False
    rec = find_recordings(Path(root))
    if not rec:
        raise RecordingNotFound(
            f"no recording under {root}/: make one with `replay record -- CMD`, or give its path"
        )
    return rec[-1], True


@dataclass(slots=True)
class StepView:
    """One recorded step of one rank: its summary row and its tensors (loaded on demand)."""

    rank_file: "RankFile"
    row: np.void

    @property
    def step(self) -> int:
        return int(self.row["step"])

    @property
    def ok(self) -> bool:
        return int(self.row["status"]) == StepStatus.OK

    @property
    def mode(self) -> str:
        return RunMode(int(self.row["mode"])).name.lower()

    @property
    def graph_key(self) -> str:
        return self.rank_file.tables.string(int(self.row["graph_key"]))

    @property
    def reason(self) -> str:
        return self.rank_file.tables.string(int(self.row["reason"]))

    @property
    def margin(self) -> float | None:
        m = float(self.row["margin"])
        return None if math.isnan(m) else m

    def _rows(self, kind: TensorKind) -> np.ndarray:
        rows = self.rank_file.tensor_rows(self.step)
        return rows[rows["kind"] == int(kind)]

    def digests(self, kind: TensorKind) -> dict[str, int]:
        tables = self.rank_file.full()
        return {tables.string(int(r["name"])): int(r["digest"]) for r in self._rows(kind)}

    def tensors(self, kind: TensorKind) -> dict[str, torch.Tensor]:
        tables = self.rank_file.full()
        out = {}
        for r in self._rows(kind):
            name = tables.string(int(r["name"]))
            if int(r["offset"]) < 0:
                raise OutOfRange(
                    f"{kind.name.lower()} {name!r} of step {self.step} was recorded as a digest only"
                )
            out[name] = self.rank_file.read_tensor(r)
        return out

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return self.tensors(TensorKind.INPUT)

    def fields(self) -> list[tuple[str, int]]:
        f = self.rank_file.tables.fields
        rows = f[f["step"] == self.step]
        rows = rows[np.argsort(rows["order"], kind="stable")]
        return [(self.rank_file.tables.string(int(r["field"])), int(r["digest"])) for r in rows]


class RankFile:
    """One rank of one part: a sealed ``.h5`` file, or a journal (live, or left by a crash)."""

    def __init__(self, part_dir: Path, rank: int) -> None:
        self.rank = rank
        stem = f"rank-{rank:05d}"
        self.h5_path = part_dir / f"{stem}.h5"
        self.journal_path = part_dir / f"{stem}.journal"
        self.payload_path = part_dir / f"{stem}.payload"
        self.sealed = self.h5_path.exists()
        self.live = (not self.sealed) and journal_is_live(self.journal_path)
        self._summary: RankTables | None = None
        self._full: RankTables | None = None
        self._collectives: np.ndarray | None = None  # read alone by ``collectives()`` (a sealed file)
        self._journal_problem: str | None = None
        # False: the caller reads every stored tensor itself and says which are cut off (verify).
        self.check_payload_size = True
        self._by_step: tuple[np.ndarray, np.ndarray] | None = None
        # (offset, nbytes, digest) of large stored bytes already found to match their digest: a
        # keyframe restored again (each re-run mode, each bisection probe) is hashed once.
        self._digest_checked: set[tuple[int, int, int]] = set()
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.h5_path if self.sealed else self.journal_path

    def _load(self, full: bool) -> RankTables:
        try:
            if not self.sealed:
                try:
                    return self._load_journal()
                except FileNotFoundError:
                    if not self.h5_path.exists():
                        raise
                    # Sealed (by its recorder at exit) between our listing and our read.
                    self.sealed, self.live = True, False
            t = _h5.read_rank_file(self.h5_path, tables=None if full else _SUMMARY_TABLES)
            self._check_payload(t.payload_size)
            return t
        except _h5._VersionError as e:
            raise FormatVersionError(
                f"{self.path}: written by format version {e.version}; this replay reads versions up to "
                f"{FORMAT_VERSION}: upgrade replay to open it"
            ) from None
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError, OverflowError) as e:
            raise RecordingDamaged(f"{self.path}: cannot be read ({_describe(e)}); `replay verify` says more") from None
        except MemoryError:
            raise RecordingDamaged(
                f"{self.path}: cannot be read (it needs more memory than this process may use); `replay verify` says more"
            ) from None

    def _check_payload(self, declared: int) -> None:
        """A sealed rank's payload file holds at least the bytes its index declares: one cut
        short (in transit, a full disk) is damage, said when the rank is opened rather than at
        the first tensor read from it (a re-run would blame its own step for it)."""
        if not declared or not self.check_payload_size:
            return
        try:
            size = self.payload_path.stat().st_size
        except FileNotFoundError:
            raise RecordingDamaged(f"{self.payload_path}: is missing (the index declares {declared} bytes of it); "
                                   "`replay verify` says more") from None
        if size < declared:
            raise RecordingDamaged(f"{self.payload_path}: is truncated ({size} of the {declared} bytes its index declares); "
                                   "`replay verify` says more")

    def _load_journal(self) -> RankTables:
        builder = TablesBuilder()
        scan = scan_journal(self.journal_path, builder.add)
        self._journal_problem = scan.problem
        # The payload's size is taken after the frames are read: every whole frame points at
        # bytes written before it, so a live journal still reads consistently.
        size = self.payload_path.stat().st_size if self.payload_path.exists() else 0
        t = builder.finish(payload_size=size)
        if scan.problem and not self.live:
            t.attrs["journal_problem"] = scan.problem
            t.attrs["lost_bytes"] = scan.total_bytes - scan.valid_bytes
        return t

    @property
    def tables(self) -> RankTables:
        """Summary tables (steps, fields, attributes): what ``info`` needs, and no more."""
        with self._lock:
            if self._full is not None:
                return self._full
            if self._summary is None:
                self._summary = self._load(full=not self.sealed)
                if not self.sealed:
                    self._full = self._summary
            return self._summary

    def full(self) -> RankTables:
        with self._lock:
            if self._full is None:
                self._full = self._load(full=True)
            return self._full

    def collectives(self) -> np.ndarray:
        """The rank's collectives table, read alone from a sealed file (it grows with the run;
        ``tables`` leaves it out)."""
        with self._lock:
            if self._full is not None:
                return self._full.collectives
        if not self.sealed:
            return self.full().collectives
        if self._collectives is None:
            try:
                self._collectives = _h5.read_table(self.h5_path, "collectives")
            except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError, OverflowError) as e:
                raise RecordingDamaged(f"{self.path}: cannot be read ({_describe(e)}); `replay verify` says more") from None
        return self._collectives

    @property
    def attrs(self) -> dict[str, Any]:
        return self.tables.attrs

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get("complete")) and not self.attrs.get("journal_problem")

    @property
    def n_steps(self) -> int:
        return int(self.tables.steps.size)

    def step(self, step: int) -> StepView:
        steps = self.tables.steps
        idx = np.searchsorted(steps["step"], step)
        if idx >= steps.size or int(steps["step"][idx]) != step:
            last = int(steps["step"][-1]) if steps.size else None
            valid = f"0..{last}" if last is not None else "none"
            raise OutOfRange(f"rank {self.rank} has no step {step} (recorded steps: {valid})")
        return StepView(self, steps[idx])

    def read_tensor(self, row: np.void, *, check_digest: bool = True) -> torch.Tensor:
        """The tensor a /tensors row describes, bit for bit, as a CPU tensor.

        Its bytes are checked against the digest recorded with them (``check_digest=False``: the
        caller checks them itself, as ``verify`` does to list every damaged tensor).
        """
        t = self.full()
        name = t.string(int(row["name"]))
        try:
            dtype = str_to_dtype(t.string(int(row["dtype"])))
        except ValueError as e:
            raise TensorDamaged(f"{self.path}: tensor {name!r}: {e}") from None
        ndim = int(row["ndim"])
        shape = tuple(int(x) for x in row["shape"][:ndim])
        nbytes = int(row["nbytes"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if ndim > len(row["shape"]) or any(s < 0 for s in shape) or math.prod(shape) * itemsize != nbytes:
            raise TensorDamaged(f"{self.path}: tensor {name!r}: shape {shape} does not match its {nbytes} bytes")
        offset = int(row["offset"])
        if offset < 0 or offset + nbytes > t.payload_size:
            raise TensorDamaged(f"{self.path}: tensor {name!r} lies outside the payload file")
        try:
            # O_NONBLOCK and the checks below: a FIFO or device put where the payload should be
            # must not block, and a row claiming more bytes than the file has must not make us
            # allocate them.
            # O_NOFOLLOW: the writer never writes links; one could point at any file of the user's.
            fd = os.open(self.payload_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as fh:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise TensorDamaged(f"{self.payload_path}: is not a regular file")
                if offset + nbytes > st.st_size:
                    raise TensorDamaged(f"{self.payload_path}: ends before tensor {name!r} (file truncated)")
                # The payload is written front to back, never with holes: a sparse one (a file of
                # kilobytes claiming gigabytes) is not what the writer writes, and reading a
                # tensor from it would allocate memory for bytes that are not there.
                blocks = getattr(st, "st_blocks", None)
                if blocks is not None and nbytes > 16 * blocks * 512 + (1 << 20):
                    raise TensorDamaged(
                        f"{self.payload_path}: tensor {name!r} claims {nbytes} bytes but the file stores only "
                        f"{blocks * 512} (a sparse or hostile file)"
                    )
                fh.seek(offset)
                data = fh.read(nbytes)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TensorDamaged(f"{self.payload_path}: is a symbolic link, not a payload file") from None
            raise TensorDamaged(f"{self.payload_path}: cannot be read ({_describe(e)})") from None
        if len(data) != nbytes:
            raise TensorDamaged(f"{self.payload_path}: ends before tensor {name!r} (file truncated)")
        if check_digest:
            self._check_digest(row, name, data)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)

    def _check_digest(self, row: np.void, name: str, data: bytes) -> None:
        """The bytes read are the bytes recorded. Every tensor a re-run feeds, restores or
        compares with is read here: changed bytes taken as recorded would make it blame the
        program (a departure, a difference) for damage to the file."""
        key = (int(row["offset"]), int(row["nbytes"]), int(row["digest"]))
        if key in self._digest_checked:
            return
        if digest_bytes(data) != key[2]:
            step = int(row["step"])
            where = f"of step {step}" if step >= 0 else "recorded outside a step"
            raise TensorDamaged(
                f"{self.payload_path}: tensor {name!r} {where}: its stored bytes do not match the digest recorded "
                "with them: the recording is damaged; `replay verify` says more"
            )
        if key[1] >= _DIGEST_REMEMBERED_BYTES:
            self._digest_checked.add(key)

    def tensor_rows(self, step: int) -> np.ndarray:
        """The /tensors rows of one step, in recording order (indexed once, then O(log n))."""
        t = self.full()
        with self._lock:
            if self._by_step is None:
                order = np.argsort(t.tensors["step"], kind="stable")
                self._by_step = (order, t.tensors["step"][order])
            order, steps = self._by_step
        lo, hi = np.searchsorted(steps, step, "left"), np.searchsorted(steps, step, "right")
        return t.tensors[np.sort(order[lo:hi])]

    def keyframe_steps(self) -> list[int]:
        return [int(s) for s in self.full().keyframes["step"]]

    def keyframe(self, at_or_before: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest state keyframe taken at or before ``at_or_before``: (step, tensors)."""
        t = self.full()
        k = t.keyframes[t.keyframes["step"] <= at_or_before]
        if not k.size:
            return None
        row = k[np.argmax(k["step"])]
        return int(row["step"]), {t.string(int(r["name"])): self.read_tensor(r) for r in self._keyframe_rows(row)}

    def _keyframe_rows(self, row: Any) -> np.ndarray:
        """The /tensors rows of one keyframe (checked to lie inside the table)."""
        t = self.full()
        first, n = int(row["first_tensor"]), int(row["n_tensors"])
        if first < 0 or n < 0 or first + n > t.tensors.size:
            raise RecordingDamaged(f"{self.path}: keyframe at step {int(row['step'])} points outside /tensors")
        return t.tensors[first : first + n]

    def keyframe_python_state(self, at_or_before: int) -> tuple[int, dict[str, Any]] | None:
        """The target's Python attributes (``replay.core.state``: its own and its submodules'
        int/float/bool/str ones) in the newest keyframe at or before ``at_or_before``: (its step,
        {dotted name: value}), reading only those rows; None when there is no such keyframe."""
        from replay.core.state import SCALAR_PREFIX, STR_PREFIX, STR_UNCHANGED_PREFIX, UNCHANGED_PREFIX, split_scalars

        t = self.full()
        k = t.keyframes[t.keyframes["step"] <= at_or_before]
        if not k.size:
            return None
        row = k[np.argmax(k["step"])]
        prefixes = (SCALAR_PREFIX, UNCHANGED_PREFIX, STR_PREFIX, STR_UNCHANGED_PREFIX)
        rows = {}
        for r in self._keyframe_rows(row):
            name = t.string(int(r["name"]))
            if name.startswith(prefixes) and int(r["ndim"]) <= 1:
                rows[name] = self.read_tensor(r)
        unchanged: dict[str, Any] = {}
        _, changed = split_scalars(rows, unchanged)
        return int(row["step"]), {**unchanged, **changed}

    def first_keyframe_scalars(self) -> tuple[int, dict[str, bool | int | float]] | None:
        """The Python scalars of the target (``replay.core.state``) in the first keyframe:
        (its step, {attribute: value}), reading none of the keyframe's tensors; None when the
        rank took no keyframe."""
        from replay.core.state import SCALAR_PREFIX, UNCHANGED_PREFIX

        t = self.full()
        k = t.keyframes
        if not k.size:
            return None
        row = k[np.argmin(k["step"])]
        out: dict[str, bool | int | float] = {}
        for r in self._keyframe_rows(row):
            name = t.string(int(r["name"]))
            prefix = next((p for p in (SCALAR_PREFIX, UNCHANGED_PREFIX) if name.startswith(p)), None)
            if prefix is None or int(r["ndim"]) != 0:
                continue
            v = self.read_tensor(r)
            out[name[len(prefix):]] = bool(v.item()) if v.dtype == torch.bool else v.item()
        return int(row["step"]), out

    def tuner_choices(self) -> dict[str, str]:
        t = self.tables
        return {t.string(int(r["op"])): t.string(int(r["tactic"])) for r in t.tuner}


class Part(Mapping[int, RankFile]):
    """The rank files of one multi-rank run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        ranks: set[int] = set()
        for f in path.glob("rank-*.*"):
            if f.suffix in (".h5", ".journal"):
                r = parse_rank_stem(f.stem)
                if r is not None:
                    ranks.add(r)
        self._files = {r: RankFile(path, r) for r in sorted(ranks)}

    def __getitem__(self, rank: int) -> RankFile:
        try:
            return self._files[rank]
        except KeyError:
            raise OutOfRange(f"part {self.name} has no rank {rank} (ranks: {_ranges(list(self._files))})") from None

    # Mapping's defaults go through __getitem__, whose OutOfRange is not a KeyError.
    def __contains__(self, rank: object) -> bool:
        return rank in self._files

    def get(self, rank: int, default: Any = None) -> Any:  # type: ignore[override]
        return self._files.get(rank, default)

    def __iter__(self) -> Iterator[int]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def without(self, ranks: Iterable[int]) -> Part:
        """This part less some of its rank files (those that cannot be read, say)."""
        drop = set(ranks)
        other = Part.__new__(Part)
        other.path, other.name = self.path, self.name
        other._files = {r: f for r, f in self._files.items() if r not in drop}
        return other

    @property
    def world_size(self) -> int:
        """The world size the ranks declared (a damaged rank file is skipped, not fatal).

        A declared size beyond ``MAX_WORLD_SIZE`` is damage, not a run: it is ignored, so that
        listing the ranks it says are missing cannot take unbounded time and memory.
        """
        sizes = {len(self._files)}
        for f in self._files.values():
            try:
                ws = f.attrs.get("world_size", 0)
                if isinstance(ws, int) and 0 < ws <= MAX_WORLD_SIZE:
                    sizes.add(ws)
            except RecordingDamaged:
                continue
        return max(sizes)


class Recording(Mapping[str, Part]):
    """A recording directory. Use as a context manager or call ``close()``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise RecordingNotFound(f"no recording at {self.path}")
        if not self.path.is_dir():
            raise RecordingDamaged(f"{self.path} is a file, not a recording: give the directory `replay record` wrote")
        try:
            self.manifests = read_manifests(self.path)
        except ValueError as e:
            raise RecordingDamaged(f"{self.path}: {e}") from None
        for m in self.manifests:
            if m.get("kind", RECORDING_KIND) != RECORDING_KIND:
                raise RecordingDamaged(f"{self.path}: manifest is not a replay recording manifest")
            v = m.get("format_version")
            if not isinstance(v, int) or v < 1:
                raise RecordingDamaged(f"{self.path}: manifest has no valid format_version")
            if v > FORMAT_VERSION:
                raise FormatVersionError(
                    f"{self.path}: written by format version {v}; this replay reads versions up to "
                    f"{FORMAT_VERSION}: upgrade replay to open it"
                )
        parts = sorted(p for p in self.path.iterdir() if p.is_dir() and _is_part_dir(p))
        if not parts:
            if self.manifests and self.manifest.get("status") in ("starting", "recording") and "exit_code" not in self.manifest:
                raise RecordingDamaged(
                    f"{self.path}: no rank has started recording yet: the command{_started_note(self.manifest)} is "
                    "still starting (or its `replay record` was killed before any rank began); try again in a moment"
                )
            if self.manifests:
                raise RecordingDamaged(
                    f"{self.path}: nothing was recorded: the command ended before any rank started recording"
                    f"{_exit_note(self.manifest)}"
                )
            raise RecordingDamaged(
                f"{self.path}: not a recording (no rank files found): give the directory `replay record` wrote"
            )
        self._parts = {p.name: Part(p) for p in parts}

    @property
    def manifest(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for m in reversed(self.manifests):
            merged.update(m)
        return merged

    def __getitem__(self, name: str) -> Part:
        try:
            return self._parts[name]
        except KeyError:
            raise OutOfRange(f"{self.path} has no part {name!r} (parts: {', '.join(self._parts)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._parts.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def close(self) -> None:
        self._parts.clear()

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_recording(path: str | os.PathLike | None = None, root: str | os.PathLike = "recordings") -> Recording:
    """Open ``path``, or the newest recording under ``root``."""
    p, _ = resolve_recording(path, root)
    return Recording(p)


def _exit_note(manifest: dict[str, Any]) -> str:
    code = manifest.get("exit_code")
    return f" (its exit code was {code})" if isinstance(code, int) and not isinstance(code, bool) else ""


def _started_note(manifest: dict[str, Any]) -> str:
    t = manifest.get("started_at")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
        import time

        try:
            return f" (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))})"
        except (OverflowError, OSError, ValueError):
            return ""
    return ""


def _describe(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
    if "file signature not found" in msg:
        return "not an HDF5 file"
    if "truncated file" in msg:
        return "HDF5 file is truncated"
    if "filter returned failure" in msg:
        return "a table's checksum does not match: the file changed after it was sealed"
    if "checksum" in msg:
        return "HDF5 metadata checksum mismatch: the file changed after it was sealed"
    return msg[:200]


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    xs = sorted(xs)
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}..{xs[-1]}" if len(xs) > 1 else str(xs[0])
    return ", ".join(map(str, xs))
