"""Recorder settings: one dataclass, one field per knob, checked on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["RecorderConfig"]

_MODES = ("digest", "full")


@dataclass(kw_only=True, slots=True)
class RecorderConfig:
    out: Path
    """The recording directory; this rank writes under ``out/part``."""

    part: str = "run-000"
    """The part (one multi-rank run) this rank belongs to."""

    rank: int = 0
    """Global rank of this process."""

    world_size: int = 1
    """Number of ranks in the run."""

    durability: Literal["step", "async"] = "step"
    """Used only without a record ring (``record_ring_bytes=0``, no ``/dev/shm``, or a CUDA that
    cannot register it). ``step``: ``end_step`` returns once the step is in the journal, so a
    SIGKILL right after cannot lose it. ``async``: return at once; a kill may lose the steps still
    queued. With the ring (the default) both mean the same: a step is durable once its record is
    in the ring: for host data when ``end_step`` returns, for device data once the GPU has run
    the step's copies (before anything the program queues after the step, so before it can read
    the step's outputs back). Figures: ``benchmarks/RESULTS.md``."""

    record_ring_bytes: int = 64 << 20
    """Size of this rank's record ring, a file in ``record_ring_dir`` mapped shared and
    registered with CUDA: the step path writes its record there and returns; a drain thread moves
    it to the journal; a killed rank's ring is salvaged by ``replay seal``. 0: no ring."""

    record_ring_dir: str = "/dev/shm"
    """Where the ring file lives: a tmpfs, so that the ring outlives the process, not the host."""

    drain_lag_s: float = 0.05
    """With the ring: a step's record is moved to the journal when the next step is handed over
    (when the program usually waits on the device) or after this many seconds, whichever comes
    first; 0 writes each step at once, competing with the program for the interpreter just as
    the step ends. Durability does not depend on it: the record is in the ring already."""

    ring_full: Literal["block", "drop"] = "block"
    """When the ring has no room (the drain is behind the program): ``block`` waits at the step
    (up to ``sync_timeout_s``), ``drop`` records the step as a gap (a note naming it) and goes
    on. The waits, their time and the dropped steps are in the end marker and the notes."""

    keyframe_every: int = 0
    """Snapshot the target's state every K steps (0: only before the first step)."""

    keyframe_budget: int = 1 << 20
    """Average keyframe bytes per step allowed: a state larger than ``keyframe_every x budget``
    (a GPU KV cache) is snapshotted less often, every ceil(state bytes / budget) steps."""

    ring: int = 0
    """Keep the full logits of the last N steps; written at exit, on a crash, or on a trigger."""

    inputs: Literal["digest", "full"] = "full"
    """Step inputs: exact bits (``full``, needed to re-run) or digests only."""

    outputs: Literal["digest", "full"] = "digest"
    """Step outputs: digests only, or exact bits too."""

    collectives: Literal["digest", "auto", "full"] = "auto"
    """Collective outputs: digests only, in full (a single rank can then be replayed alone), or
    ``auto``: in full when an output is at most ``collective_full_bytes`` (lockstep all-gathers
    of token counts, small decode all-reduces), digests otherwise."""

    collective_full_bytes: int = 1 << 20
    """With ``collectives="auto"``: the largest output kept in full."""

    logits: str | None = "logits"
    """Name of the step output holding logits: its top-1/top-2 margin is recorded every step."""

    token_outputs: tuple[str, ...] = ("tokens", "accepted", "sampled", "next_tokens")
    """Step outputs recorded in full as tokens (the field users compare first)."""

    accepted: str | None = "accepted"
    """Name of the step output counting accepted tokens (summed into the step summary)."""

    rng: bool = True
    """Capture RNG state (torch CPU and CUDA, Python, NumPy) at each step start."""

    max_bytes: int | None = None
    """Stop recording (with one warning) once this rank's files would exceed this many bytes."""

    queue_depth: int = 256
    """Steps queued for the writer thread before ``end_step`` waits for it."""

    sync_timeout_s: float = 30.0
    """How long ``end_step`` waits for the writer before recording is switched off."""

    target: dict[str, Any] = field(default_factory=dict)
    """What a re-run needs to rebuild the target: factory, config, step callable, state names."""

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        if self.durability not in ("step", "async"):
            raise ValueError(f"durability must be 'step' or 'async', not {self.durability!r}")
        for name in ("inputs", "outputs"):
            if getattr(self, name) not in _MODES:
                raise ValueError(f"{name} must be one of {', '.join(_MODES)}")
        if self.collectives not in ("digest", "auto", "full"):
            raise ValueError("collectives must be one of digest, auto, full")
        if self.ring_full not in ("block", "drop"):
            raise ValueError(f"ring_full must be 'block' or 'drop', not {self.ring_full!r}")
        if self.record_ring_bytes < 0:
            raise ValueError("record_ring_bytes must be >= 0")
        if self.keyframe_every < 0 or self.ring < 0 or self.queue_depth < 1:
            raise ValueError("keyframe_every and ring must be >= 0, queue_depth >= 1")
        if not self.part or "/" in self.part or self.part.startswith("."):
            raise ValueError(f"bad part name {self.part!r}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        d["token_outputs"] = list(self.token_outputs)
        return d
