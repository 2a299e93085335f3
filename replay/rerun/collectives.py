"""One rank replayed alone: torch.distributed answers with what the recording says.

As rr replays a process's system calls, a one-rank re-run replays its collectives: each call
returns the output the rank received when it was recorded (``--collectives full``), in the order
it made them. The re-run's own collective inputs are digested and compared with the recorded
ones, which tells whether the rank's local computation up to each collective still matches.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from replay.digest import digest, local_tensor
from replay.errors import RerunError
from replay.format.reader import RankFile
from replay.format.tables import combine_digests
from replay.core.collectives import COLLECTIVES, FUNCTIONAL, FUNCTIONAL_PREFIX

# Without a factory, `--ranks` re-launches each rank alone on its recorded collectives; only ranks
# rebuilt by a factory form a real process group, so that is the advice that works.
TOGETHER = "re-run every rank together with `replay step --ranks 0-N --factory F` (collectives then run live)"

__all__ = ["RecordedCollectives", "CollectiveMismatch"]


@dataclass(slots=True)
class CollectiveMismatch:
    step: int
    index: int  # position within the step
    op: str

    def __str__(self) -> str:
        return f"step {self.step}, collective #{self.index} ({self.op}): its input differs from the recorded one"

    @property
    def field(self) -> str:
        """As a departure's field: what left the recording at ``step``."""
        return f"collective #{self.index} ({self.op}) input"


def copy_output(dst: Any, out: torch.Tensor) -> None:
    """A recorded collective output into the program's output argument: a tensor, or a list of
    tensors (all_gather's ``tensor_list``, recorded stacked)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(out.reshape(dst.shape).to(dst.device))
    elif isinstance(dst, (list, tuple)):
        for d, o in zip(dst, out.reshape(len(dst), *dst[0].shape)):
            d.copy_(o.to(d.device))


class _DoneWork:
    """What an ``async_op=True`` call returns: the recorded output is already in place."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(None)
        return f


class _Group:
    """A process group stand-in for ``new_group`` in a one-rank re-run."""

    def __init__(self, ranks: list[int] | None, world: int) -> None:
        self.ranks = ranks if ranks is not None else list(range(world))
        self.group_name = f"replay-group-{'-'.join(map(str, self.ranks))}"

    def size(self) -> int:
        return len(self.ranks)


@dataclass(slots=True)
class RecordedCollectives:
    rank_file: RankFile
    rank: int
    world_size: int
    mismatches: list[CollectiveMismatch] = field(default_factory=list)
    _rows: np.ndarray | None = None
    _queue: list[np.void] = field(default_factory=list)
    _step: int = -1
    _index: int = 0
    _installed: bool = False  # between installed()'s patching and its restoring
    _active: bool = False  # inside a step (functional collectives outside one pass through)
    # The step ran under torch.compile when recorded: collectives inside its graph were not seen.
    recorded_compiled: bool = False

    def _step_rows(self, step: int) -> list[np.void]:
        """The collectives made inside ``step``, in order. The table also holds, under the same
        step, those the program made after it and before the next (a loop that all-gathers the
        sampled token): they come after the step's own, whose number the step's row keeps."""
        t = self.rank_file.full()
        c = t.collectives
        rows = c[c["step"] == step]
        rows = list(rows[np.argsort(rows["ordinal"], kind="stable")])
        s = t.steps[t.steps["step"] == step]
        return rows[: int(s["n_collectives"][0])] if len(s) else rows

    def check_replayable(self, first: int, last: int) -> None:
        """Fail before anything is built if a collective in steps first..last lacks its output."""
        t = self.rank_file.full()
        steps = np.unique(t.collectives["step"][(t.collectives["step"] >= first) & (t.collectives["step"] <= last)])
        rows = [r for s in steps for r in self._step_rows(int(s)) if int(r["out_tensor"]) < 0]
        for row in rows:
            op = t.string(int(row["op"]))
            if op.startswith(FUNCTIONAL_PREFIX) or COLLECTIVES.get(op, COLLECTIVES["barrier"]).outputs:
                raise RerunError(f"step {int(row['step'])}: {self._why_no_output(row, op)}")

    def departure_at(self, step: int) -> CollectiveMismatch | None:
        """The first collective of ``step`` whose input in the re-run differs from the recorded
        one: the rank's own computation departed before it, whatever its outputs (a one-rank
        re-run hands every collective its recorded result, so outputs after it can match)."""
        return next((m for m in self.mismatches if m.step == step), None)

    def _why_no_output(self, row: np.void, what: str) -> str:
        """Why a collective's output is not in the recording, and what to do instead."""
        shapes = self.rank_file.full().string(int(row["shapes"]))
        if shapes.replace(" ", "").endswith("->[]") and not int(row["compare"]):
            # Started with async_op=True: its output is not there when the call returns, so only
            # its input was recorded, whatever --collectives says.
            return (f"{what} was called with async_op=True, whose output the recorder does not see (only its input "
                    f"is recorded), so rank {self.rank} cannot be replayed alone; {TOGETHER}")
        return (f"{what} was recorded as a digest only, so rank {self.rank} cannot be replayed alone; record with "
                f"`replay record --collectives full`, or {TOGETHER}")

    def begin_step(self, step: int) -> None:
        self._queue = self._step_rows(step)
        self._step = step
        self._index = 0
        self._active = True

    def end_step(self) -> None:
        self._active = False
        if self._queue:
            ops = ", ".join(self.rank_file.full().string(int(r["op"])) for r in self._queue[:3])
            raise RerunError(
                f"step {self._step}: the re-run made {self._index} collectives, the recording has "
                f"{self._index + len(self._queue)} (next recorded: {ops})"
            )

    def _next(self, op: str, inputs: list[torch.Tensor]) -> np.void:
        t = self.rank_file.full()
        if not self._queue and self._index == 0 and self.recorded_compiled:
            raise RerunError(
                f"step {self._step}: the re-run called {op}, but the recording holds no collective for this step: it ran "
                f"compiled on {self.world_size} ranks, and collectives inside a compiled graph are not recorded, so "
                f"rank {self.rank} cannot be re-run with recorded answers; {TOGETHER}"
            )
        if not self._queue:
            view = self.rank_file.step(self._step) if self._step >= 0 else None
            if view is not None and not view.ok:
                # The step raised when recorded, most often inside this very collective (a peer
                # gone): it never completed, so it has nothing to hand back.
                raise RerunError(
                    f"step {self._step} raised when recorded ({view.reason}); the re-run reached {op} (collective "
                    f"#{self._index}), which did not complete then, so the step cannot be re-run alone past it: not compared"
                )
            raise RerunError(
                f"step {self._step}: the re-run called {op} (collective #{self._index}) but the recording has no more "
                "collectives in this step: the rebuilt target does not follow the recorded code path"
            )
        row = self._queue.pop(0)
        rec_op = t.string(int(row["op"]))
        if rec_op != op:
            raise RerunError(
                f"step {self._step}: collective #{self._index} was {rec_op} when recorded but {op} in the re-run"
            )
        if inputs and combine_digests(digest(x) for x in inputs) != int(row["in_digest"]):
            self.mismatches.append(CollectiveMismatch(self._step, self._index, op))
        self._index += 1
        return row

    def _output(self, row: np.void, op: str) -> torch.Tensor:
        i = int(row["out_tensor"])
        if i < 0:
            raise RerunError(f"step {self._step}: {self._why_no_output(row, f'{op} (collective #{self._index - 1})')}")
        t = self.rank_file.full()
        return self.rank_file.read_tensor(t.tensors[i])

    # -- the stand-ins -------------------------------------------------------------------------

    def _make(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        spec = COLLECTIVES[name]
        sig = inspect.signature(orig)

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            if not self._installed:
                # A module imported while the stand-ins were in place keeps them (``from c10d
                # import scatter``): once the re-run is over, they are torch's own again.
                return orig(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            ins: list[torch.Tensor] = []
            for p in spec.inputs:
                v = a.get(p)
                ins += [v] if isinstance(v, torch.Tensor) else [x for x in (v or []) if isinstance(x, torch.Tensor)]
            row = self._next(name, ins)
            if spec.outputs:
                out = self._output(row, name)
                copy_output(a.get(spec.outputs[0]), out)
            return _DoneWork() if a.get("async_op") else None

        return stand_in

    def _make_functional(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(orig)
        op = FUNCTIONAL_PREFIX + name

        def functional_stand_in(*args: Any, **kwargs: Any) -> Any:
            if not self._active or not self._installed:
                # Outside any step (the factory sharding a model, a graph warm-up): the fake
                # process group answers, as the recording kept nothing of it.
                return orig(*args, **kwargs)
            first = next(iter(sig.bind(*args, **kwargs).arguments.values()), None)
            if not isinstance(first, torch.Tensor):
                raise RerunError(
                    f"step {self._step}: {op} (collective #{self._index}) takes a list of tensors, which a one-rank "
                    f"re-run cannot replay yet; {TOGETHER}"
                )
            x = local_tensor(first)
            row = self._next(op, [x])
            return self._output(row, op).to(x.device)

        return functional_stand_in

    def uses_functional(self) -> bool:
        """Whether the rank made functional collectives (DTensor, tensor parallelism)."""
        t = self.rank_file.full()
        return any(t.string(int(op)).startswith(FUNCTIONAL_PREFIX) for op in np.unique(t.collectives["op"]))

    @contextlib.contextmanager
    def installed(self) -> Iterator["RecordedCollectives"]:
        """Patch torch.distributed for the duration of the re-run; restore it afterwards.

        A rank that made functional collectives (a DTensor model) gets a real, fake process
        group of the recorded rank and world size, since a device mesh cannot be built on
        stand-ins; its collectives inside steps still return the recorded outputs."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        world, rank = self.world_size, self.rank
        fake = self.uses_functional() and not dist.is_initialized()
        if fake:
            _init_fake_process_group(rank, world)
        patches: dict[str, Any] = {} if fake else {
            "is_initialized": lambda: True,
            "is_available": lambda: True,
            "get_rank": lambda group=None: rank if group is None else (group.ranks.index(rank) if isinstance(group, _Group) and rank in group.ranks else rank),
            "get_world_size": lambda group=None: world if group is None or not isinstance(group, _Group) else group.size(),
            "get_backend": lambda group=None: "replay",
            "new_group": lambda ranks=None, *a, **k: _Group(list(ranks) if ranks is not None else None, world),
            "get_process_group_ranks": lambda group=None: group.ranks if isinstance(group, _Group) else list(range(world)),
            "destroy_process_group": lambda group=None: None,
        }
        for name in COLLECTIVES:
            orig = getattr(c10d, name, None)
            if orig is not None:
                patches[name] = self._make(name, getattr(orig, "__wrapped__", orig))
        saved: list[tuple[Any, str, Any]] = []
        for owner in (dist, c10d):
            for name, fn in patches.items():
                if hasattr(owner, name):
                    saved.append((owner, name, getattr(owner, name)))
                    setattr(owner, name, fn)
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:  # pragma: no cover - torch built without distributed
            funcol = None
        for name in FUNCTIONAL if funcol is not None else ():
            orig = getattr(funcol, name, None)
            if callable(orig):
                saved.append((funcol, name, orig))
                setattr(funcol, name, self._make_functional(name, orig))
        self._installed = True
        try:
            yield self
        finally:
            self._installed = False
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)
            if fake and dist.is_initialized():
                dist.destroy_process_group()


def _init_fake_process_group(rank: int, world: int) -> None:
    """A process group that communicates nothing: rank ``rank`` of ``world``, in this process."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError as e:
        raise RerunError(
            f"rank {rank} made functional collectives (DTensor), which a one-rank re-run replays on torch's fake "
            f"process group, not importable here ({e}); {TOGETHER}"
        ) from None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
