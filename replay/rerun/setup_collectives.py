"""The collectives a re-launched rank makes before its first recorded step, answered from the
recording.

A rank re-launched alone runs the program's start-up on a process group that communicates
nothing (``relaunch._fake_process_group``). What the start-up received from the other ranks is
then missing: weights broadcast from rank 0 (DDP-style set-up), a request read by rank 0 and sent
with ``broadcast_object_list``. The recorder kept those collectives (step -1 in the rank's
collectives table, their outputs in full up to ``--collectives``' limit): until the re-run takes
over the step, each collective the program makes is matched, in order, with the next recorded
one and given its recorded output. The first that does not match (another op, no output kept)
ends the answering; from there the fake group answers, as before, and ``summary`` says so.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np
import torch

from replay.core.collectives import COLLECTIVES
from replay.format.reader import RankFile
from replay.rerun.collectives import _DoneWork, copy_output

__all__ = ["SetupAnswers"]


class SetupAnswers:
    """Recorded answers to the collectives the program makes before the re-run takes over."""

    def __init__(self, rf: RankFile, taken_over: Callable[[], bool]) -> None:
        t = rf.full()
        c = t.collectives
        rows = c[c["step"] < 0]
        self._queue = list(rows[np.argsort(rows["ordinal"], kind="stable")])
        self._rf = rf
        self._taken_over = taken_over
        self.answered = 0
        self.recorded = len(self._queue)
        self.stopped_at: str | None = None  # why answering stopped early ("broadcast: no output kept")

    def install(self) -> None:
        if not self._queue:
            return
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name, spec in COLLECTIVES.items():
            orig = getattr(c10d, name, None)
            if orig is None or not spec.outputs:
                continue
            stand_in = self._stand_in(name, orig)
            for owner in (c10d, dist):
                if getattr(owner, name, None) is orig:
                    setattr(owner, name, stand_in)

    def _stand_in(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(orig)
        out_param = COLLECTIVES[name].outputs[0]

        @functools.wraps(orig)
        def setup_collective(*args: Any, **kwargs: Any) -> Any:
            if not self._queue or self._taken_over():
                return orig(*args, **kwargs)
            try:
                a = sig.bind(*args, **kwargs).arguments
            except TypeError:
                return orig(*args, **kwargs)  # the program's own error
            out = self._answer(name, a.get(out_param))
            if out is None:
                return orig(*args, **kwargs)
            return _DoneWork() if a.get("async_op") else None

        return setup_collective

    def _answer(self, name: str, dst: Any) -> bool | None:
        """Copy the next recorded output into ``dst``; None: not answered (answering stops)."""
        t = self._rf.full()
        row = self._queue[0]
        op = t.string(int(row["op"]))
        i = int(row["out_tensor"])
        if op != name or i < 0 or not isinstance(dst, (torch.Tensor, list, tuple)):
            self.stopped_at = (f"{name} where the recording has {op}" if op != name else
                               f"{name} (#{self.answered + 1}): its output was recorded as a digest only")
            self._queue.clear()
            return None
        try:
            copy_output(dst, self._rf.read_tensor(t.tensors[i]))
        except (RuntimeError, ValueError, IndexError) as e:
            self.stopped_at = f"{name} (#{self.answered + 1}): the recorded output does not fit ({e})"
            self._queue.clear()
            return None
        self._queue.pop(0)
        self.answered += 1
        return True

    def summary(self) -> str | None:
        """What a verdict should know: set-up collectives the re-run could not answer."""
        if self.recorded and self.stopped_at is not None:
            return (f"the program's start-up made {self.recorded} collective(s) before the first recorded step; the "
                    f"re-run answered {self.answered} from the recording and stopped at {self.stopped_at}: what the rank "
                    "received there (weights broadcast from rank 0, a request) is missing from the re-run; record with "
                    "--collectives full, or re-run every rank together")
        return None
