"""One recording's settings: one dataclass, one docstring and one default per field, checked on
construction.

``RecordConfig`` is filled, later sources winning, by its defaults, the ``[tool.replay]`` table of
the project's ``pyproject.toml`` (``replay.record.settings``), and the command line of ``replay
record``; it travels to every process ``replay record`` starts as one JSON object in the
environment, and from there, unchanged, to each rank's ``Recorder`` inside a ``RecorderConfig``:
the same fields plus where this rank writes (``out``, ``part``, ``rank``, ``world_size``).
A program that drives ``replay.Recorder`` itself builds the ``RecorderConfig`` directly; it gets
the same defaults as ``replay record``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

__all__ = ["RecordConfig", "RecorderConfig"]


@dataclass(kw_only=True, slots=True)
class RecordConfig:
    """What to record and how: the options of ``replay record``, the keys of ``[tool.replay]``."""

    # -- which calls are steps (read by ``replay record``'s session in each process) -----------

    steps: list[str] = field(default_factory=list)
    """Callables whose calls are steps: ``module:qualname`` (function, method, or nn.Module class)."""

    profile: str = "auto"
    """A built-in profile (``mtp``), ``auto`` (arm every built-in profile; each activates when
    its module is imported), or ``none``."""

    state: str | None = None
    """Attribute or zero-argument method of the step's object that returns ``{name: tensor}``:
    the state a keyframe snapshots and a re-run restores."""

    config: str | None = None
    """Attribute or zero-argument method of the step's object returning the JSON-safe config the
    factory rebuilds it from."""

    factory: str | None = None
    """``module:qualname`` of ``f(config, *, rank, world_size, device, options) -> target``."""

    tuner: str | None = None
    """Attribute or method of the step's object returning ``{op: tactic}`` (recorded after capture)."""

    run_info: str | None = None
    """Attribute of the step's object: ``{"mode", "key", "padded_size", "reason"}`` after a step."""

    modules: str | None = None
    """Attribute of the step's object holding its ``nn.Module`` (for per-layer bisection)."""

    graph_capture: list[str] = field(default_factory=list)
    """Callables that capture a graph (their arguments form its key): custom or CPU runners."""

    graph_replay: list[str] = field(default_factory=list)
    """Callables that replay a captured graph (their arguments name which)."""

    probes: list[str] = field(default_factory=list)
    """Callables called inside a step whose outputs are recorded as fields of the step (they
    show what a step computed even when it later raises)."""

    output_names: list[str] = field(default_factory=list)
    """Names for a step's returned values when it returns a tuple (default: out0, out1, ...):
    ``--output-name``; in ``[tool.replay]`` also ``outputs = [...]`` (a list), its older name."""

    # -- what each step records ----------------------------------------------------------------

    keyframe_every: int = 50
    """Snapshot the target's state every K steps (fewer when the state is large, see
    ``keyframe_budget``); 0: only before the first step."""

    keyframe_budget: int = 1 << 20
    """Average keyframe bytes per step allowed: a state larger than ``keyframe_every x budget``
    (a GPU KV cache) is snapshotted less often, every ceil(state bytes / budget) steps."""

    ring: int = 16
    """Keep the full logits of the last N steps (512 MiB at most: fewer steps when the logits are
    large); written at exit, when a step raises, and at a lockstep trigger. 0: none."""

    inputs: Literal["digest", "full"] = "full"
    """Step inputs: exact bits (``full``, what a re-run feeds) or digests only."""

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

    cuda_graph_kernels: bool = True
    """Capture CUDA graphs in debug mode to list the kernels inside them."""

    # -- how it is written -----------------------------------------------------------------------

    durability: Literal["step", "async"] = "step"
    """Used only without a record ring (``record_ring_mib = 0``, no ``/dev/shm``, or a CUDA that
    cannot register it). ``step``: ``end_step`` returns once the step is in the journal, so a
    SIGKILL right after cannot lose it. ``async``: return at once; a kill may lose the steps still
    queued. With the ring (the default) both mean the same: a step is durable once its record is
    in the ring: for host data when ``end_step`` returns, for device data once the GPU has run
    the step's copies (before anything the program queues after the step, so before it can read
    the step's outputs back). Figures: ``benchmarks/RESULTS.md``."""

    record_ring_mib: int = 64
    """Size of each rank's record ring (MiB), a file in ``record_ring_dir`` mapped shared and
    registered with CUDA: the step path writes its record there and returns; a drain (``drain``)
    moves it to the journal; a killed rank's ring is salvaged by ``replay seal``. 0: no ring (the
    writer-thread path)."""

    record_ring_dir: str = "/dev/shm"
    """Where the ring file lives: a tmpfs, so that the ring outlives the process, not the host."""

    ring_full: Literal["block", "drop"] = "block"
    """When the record ring has no room (the drain is behind the program): ``block`` waits at the
    step (up to ``sync_timeout_s``), ``drop`` records the step as a gap (a note naming it) and
    goes on. The waits, their time and the dropped steps are in the end marker and the notes;
    ``replay info`` shows them."""

    drain: Literal["process", "thread"] = "process"
    """With the ring: who moves its records to the journal. ``process``: a drain process of its
    own, so that no recording work runs in the program's interpreter between steps (a drain
    thread's Python slowed the program's own step by ~0.6 ms on an H200's host, eager and on the
    CPU: ``benchmarks/RESULTS.md``). ``thread``: a thread of the program (also what is used when
    the process cannot be started)."""

    drain_lag_s: float = 0.05
    """With the ring and ``drain = "thread"``: a step's record is moved to the journal when the next step is handed over
    (when the program usually waits on the device) or after this many seconds, whichever comes
    first; 0 writes each step at once, competing with the program for the interpreter just as
    the step ends. Durability does not depend on it: the record is in the ring already."""

    max_bytes: int | None = None
    """Stop recording a rank (with one warning) once its files would exceed this many bytes;
    the program goes on."""

    queue_depth: int = 256
    """Steps queued for the writer thread before ``end_step`` waits for it."""

    sync_timeout_s: float = 30.0
    """How long ``end_step`` waits for the writer before recording is switched off."""

    # -- lockstep (``replay record`` with a process group) ---------------------------------------

    check_lockstep: bool = False
    """Compare output digests across ranks every step, through the process group's store."""

    stop_on_divergence: bool = False
    """With ``check_lockstep``: the step raises ``LockstepDivergence`` at the first mismatch."""

    lockstep_timeout_s: float = 60.0
    """How long a rank waits for the others' digests."""

    def __post_init__(self) -> None:
        # Checked where settings enter (command line, [tool.replay], the environment, a direct
        # RecorderConfig), so a bad value is one line before the program starts, never an error
        # inside its step.
        for name, kinds in _TYPES.items():
            _check_type(name, getattr(self, name), kinds)
        self.token_outputs = tuple(self.token_outputs)
        for name in ("steps", "graph_capture", "graph_replay", "probes"):
            for target in getattr(self, name):
                if ":" not in target:
                    raise ValueError(f"{target!r} is not of the form module:qualname")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)!r} must be >= 0")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth = {self.queue_depth!r} must be >= 1")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} = {value!r} is not one of: {', '.join(map(str, choices))}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes = {self.max_bytes!r} must be a positive integer")
        from replay.record.profiles import PROFILES  # (profiles.py imports this module)

        if self.profile not in ("auto", "none", *PROFILES):
            raise ValueError(f"profile = {self.profile!r} is not one of: {', '.join(PROFILES)}, auto, none")

    @property
    def record_ring_bytes(self) -> int:
        return self.record_ring_mib << 20

    def record_config(self) -> RecordConfig:
        """Only the recording's settings (a ``RecorderConfig`` less where its rank writes)."""
        return RecordConfig(**{f.name: getattr(self, f.name) for f in fields(RecordConfig)})

    def to_env(self) -> str:
        """One JSON object: how ``replay record`` hands the settings to every process it starts."""
        return json.dumps(_json_safe(asdict(self.record_config())), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> RecordConfig:
        data = json.loads(text)
        # A newer replay's extra field is ignored by an older process, not an error in its program.
        return RecordConfig(**{k: v for k, v in data.items() if k in _FIELDS})

    def merged(self, **overrides: Any) -> RecordConfig:
        """These settings with ``overrides`` (the command line) on top: None or an empty list is
        "not given"; callable lists add up, once each, in order."""
        data = asdict(self.record_config())
        for k, v in overrides.items():
            if v is None or v == [] or v == ():
                continue
            if k in ("steps", "graph_capture", "graph_replay", "probes") and data.get(k):
                data[k] = list(dict.fromkeys([*data[k], *v]))
            else:
                data[k] = v
        return RecordConfig(**data)


@dataclass(kw_only=True, slots=True)
class RecorderConfig(RecordConfig):
    """A ``RecordConfig`` and where one rank writes: what ``replay.Recorder`` takes."""

    out: Path
    """The recording directory; this rank writes under ``out/part``."""

    part: str = "run-000"
    """The part (one multi-rank run) this rank belongs to."""

    rank: int = 0
    """Global rank of this process."""

    world_size: int = 1
    """Number of ranks in the run."""

    target: dict[str, Any] = field(default_factory=dict)
    """What a re-run needs to rebuild the target: factory, config, step callable, state names."""

    def __post_init__(self) -> None:
        RecordConfig.__post_init__(self)  # (zero-argument super() fails in a slots dataclass)
        self.out = Path(self.out)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        if not self.part or "/" in self.part or self.part.startswith("."):
            raise ValueError(f"bad part name {self.part!r}")

    @classmethod
    def for_rank(cls, config: RecordConfig, *, out: Path, part: str, rank: int, world_size: int) -> RecorderConfig:
        """``config``, every field unchanged, for one rank writing under ``out/part``."""
        return cls(out=out, part=part, rank=rank, world_size=world_size,
                   **{f.name: getattr(config, f.name) for f in fields(RecordConfig)})

    def to_json(self) -> dict[str, Any]:
        return _json_safe(asdict(self))


_FIELDS = frozenset(f.name for f in fields(RecordConfig))
_LISTS = ("steps", "graph_capture", "graph_replay", "probes", "output_names", "token_outputs")
_NON_NEGATIVE = ("keyframe_every", "keyframe_budget", "ring", "collective_full_bytes", "record_ring_mib", "drain_lag_s",
                 "sync_timeout_s", "lockstep_timeout_s")
_TYPES: dict[str, tuple[type, ...]] = {
    **{n: (list, tuple) for n in _LISTS},
    **{n: (str, type(None)) for n in ("state", "config", "factory", "tuner", "run_info", "modules", "logits", "accepted")},
    **{n: (str,) for n in ("profile", "record_ring_dir", "drain")},
    **{n: (int,) for n in ("keyframe_every", "keyframe_budget", "ring", "collective_full_bytes", "record_ring_mib", "queue_depth")},
    **{n: (int, float) for n in ("drain_lag_s", "sync_timeout_s", "lockstep_timeout_s")},
    **{n: (bool,) for n in ("rng", "cuda_graph_kernels", "check_lockstep", "stop_on_divergence")},
    "max_bytes": (int, type(None)),
}
_CHOICES: dict[str, tuple[Any, ...]] = {
    "inputs": ("digest", "full"),
    "outputs": ("digest", "full"),
    "collectives": ("digest", "auto", "full"),
    "durability": ("step", "async"),
    "ring_full": ("block", "drop"),
    "drain": ("process", "thread"),
}


def _check_type(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if name in _LISTS and ok:
        ok = all(isinstance(x, str) for x in value)
    if not ok:
        want = "a list of strings" if name in _LISTS else " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{name} = {value!r} must be {want}")


def _json_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v for k, v in d.items()}
