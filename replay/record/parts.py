"""The parts of a recording (one per run) and the streams (one per model of the loop) inside one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from replay.format import perms as _perms  # issue 16

__all__ = ["Stream", "PartStreams", "allocate_part", "new_stream_name"]


@dataclass(slots=True)
class Stream:
    """One model of the loop (a target object) inside the current part."""

    name: str
    ref: Any  # a weak reference, or a function returning the object (not weak-referenceable)
    weak: bool
    info: dict[str, Any]
    state: Callable[[], dict[str, torch.Tensor]] | None = None

    def obj(self) -> Any:
        return self.ref()


@dataclass(slots=True)
class PartStreams:
    streams: list[Stream] = field(default_factory=list)

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, st in enumerate(self.streams):
            if st.state is None:
                continue
            prefix = "" if i == 0 else f"{st.name}/"
            for k, v in st.state().items():
                out[prefix + k] = v
        return out


def allocate_part(out: Path) -> str:
    """Create the next free ``run-NNN`` directory (atomic, also across nodes on a shared FS)."""
    # An unwritable directory must not raise into the program (this runs inside its step or
    # init_process_group call, and the other ranks wait for rank 0's answer): the name is
    # returned anyway, and the recorder that cannot open it switches itself off with a warning.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError:
        return "run-000"
    for i in range(100_000):
        name = f"run-{i:03d}"
        try:
            _perms.mkdir(out / name)  # issue 16: owner-only unless widened, whatever the umask
            return name
        except FileExistsError:
            continue
        except OSError:
            return name
    raise RuntimeError(f"no free part name under {out}")




def new_stream_name(streams: list[Stream], step: str, obj: Any) -> str:
    """The name of a new stream of this part (renaming a lone "main" once a second model appears)."""
    from replay.record.streams import stream_name

    taken = {s.name for s in streams}
    if any(s.obj() is obj for s in streams):
        # The same object through another step callable (prefill eager, decode compiled).
        base = step.partition(":")[2].rsplit(".", 1)[-1] or "step"
        name, i = base, 2
        while name in taken:
            name, i = f"{base}{i}", i + 1
        return name
    if not streams:
        # Named only once a second model appears: reading a caller's variables (f_locals)
        # keeps them alive in Python 3.11, and a lone engine must be freed when the program
        # drops it (a new engine is then a new part, not a stream).
        return "main"
    name = stream_name(obj, taken)
    first = streams[0]
    if first.name == "main" and len(streams) == 1 and first.obj() is not None:
        renamed = stream_name(first.obj(), {name})
        if renamed != type(first.obj()).__name__:
            first.name = renamed
    return name
