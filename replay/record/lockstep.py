"""``--check-lockstep``: compare every step's output digests across ranks while recording.

The ranks exchange one digest per step through the process group's key-value store (a side
channel: the program's own collectives are untouched). At the first mismatch every rank writes
its logits ring and a state keyframe, so the divergent step can be re-run offline; with
``--stop-on-divergence`` the step then raises ``LockstepDivergence``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from replay.digest import digest
from replay.format.tables import combine_digests

__all__ = ["Lockstep", "LockstepDivergence"]


class LockstepDivergence(RuntimeError):
    """Raised in the recorded program when ranks diverge and ``--stop-on-divergence`` is set."""


class Lockstep:
    def __init__(self, session: Any, dist: Any) -> None:
        self.session = session
        self.store = dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout = timedelta(seconds=session.settings.lockstep_timeout_s)
        self.prefix = f"replay/ls/{session.part}"
        self.diverged = False
        self.off = False

    def check(self, rec: Any, outputs: dict[str, torch.Tensor]) -> None:
        if self.off or self.diverged:
            return
        step = rec.step_index - 1
        try:
            mine = combine_digests(digest(t) for _, t in sorted(outputs.items()))
            self.store.set(f"{self.prefix}/{step}/{self.rank}", f"{mine:016x}")
            keys = [f"{self.prefix}/{step}/{r}" for r in range(self.world)]
            self.store.wait(keys, self.timeout)
            values = [self.store.get(k).decode() for k in keys]
            if step >= 2 and self.rank == 0:
                for r in range(self.world):
                    self.store.delete_key(f"{self.prefix}/{step - 2}/{r}")
        except Exception as e:  # noqa: BLE001 - a dead peer must not hang or crash this rank
            self.off = True
            self.session.warn_once("lockstep", f"lockstep check switched off at step {step} ({e})")
            return
        if len(set(values)) == 1:
            return
        self.diverged = True
        odd = [r for r, v in enumerate(values) if values.count(v) < max(values.count(x) for x in values)]
        msg = f"lockstep: output digests differ at step {step} (odd ranks: {odd or 'tie'})"
        rec.note(msg)
        rec.flush_ring(msg)
        rec.snapshot_state()
        self.session.warn_once("lockstep-div", msg)
        if self.session.settings.stop_on_divergence:
            raise LockstepDivergence(msg)
