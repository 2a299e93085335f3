"""Setting up a rank's record ring beside its journal, and removing a drained one."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from replay.format import perms as _perms  # issue 16
from replay.record.config import RecorderConfig
from replay.record.ring import ShmRing, ring_pointer

__all__ = ["open_rank_ring", "drop_drained_ring", "SMALL_RING"]

SMALL_RING = 8 << 20  # the ring's size when /dev/shm has no room for the configured one


def open_rank_ring(cfg: RecorderConfig, journal_path: Any) -> tuple[ShmRing | None, list[str]]:
    """Create this rank's record ring (registered with CUDA when CUDA is in use) and the pointer
    file beside the journal that names it; (None, why not) when there can be none."""
    if not cfg.record_ring_bytes:
        return None, []
    notes = []
    try:
        try:
            ring = ShmRing(cfg.record_ring_dir, cfg.record_ring_bytes, rank=cfg.rank)
        except OSError as e:
            if e.errno != errno.ENOSPC or cfg.record_ring_bytes <= SMALL_RING:
                raise
            # A small /dev/shm (a container's 64 MB): a smaller ring still keeps steps durable.
            ring = ShmRing(cfg.record_ring_dir, SMALL_RING, rank=cfg.rank)
            notes.append(f"no room for a {cfg.record_ring_bytes >> 20} MiB record ring in {cfg.record_ring_dir}: using {SMALL_RING >> 20} MiB")
    except Exception as e:  # noqa: BLE001 - no /dev/shm, or no room in it
        return None, [f"no record ring in {cfg.record_ring_dir} ({e.__class__.__name__}: {e}): steps go to the writer thread"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        why = ring.register_cuda()
        if why is not None:
            ring.close(unlink=True)
            return None, [f"the record ring could not be registered with CUDA ({why}): steps go to the writer thread"]
    pointer = ring_pointer(journal_path)
    tmp = pointer.with_name(pointer.name + ".tmp")
    tmp.unlink(missing_ok=True)
    _perms.write_new(tmp, (str(ring.path) + "\n").encode())
    os.replace(tmp, pointer)
    return ring, notes


def drop_drained_ring(ring: ShmRing, pointer: Any) -> None:
    """Remove a ring (and its pointer) whose records are all in the journal; else leave it for
    ``replay seal``."""
    if ring.tail != ring.head:
        return
    try:
        ring.path.unlink(missing_ok=True)
        pointer.unlink(missing_ok=True)
    except OSError:
        pass
