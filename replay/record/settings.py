"""What ``replay record`` tells every Python process it starts: one JSON object in the environment.

Settings come from three places, later ones winning: a built-in profile, the ``[tool.replay]``
table of the project's ``pyproject.toml``, and the command line.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

__all__ = ["RecordSettings", "ENV_DIR", "ENV_SETTINGS", "load_pyproject_settings"]

ENV_DIR = "REPLAY_RECORD_DIR"
ENV_SETTINGS = "REPLAY_RECORD_SETTINGS"


@dataclass(kw_only=True, slots=True)
class RecordSettings:
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

    graph_capture: list[str] = field(default_factory=list)
    """Callables that capture a graph (their arguments form its key): custom or CPU runners."""

    graph_replay: list[str] = field(default_factory=list)
    """Callables that replay a captured graph (their arguments name which)."""

    modules: str | None = None
    """Attribute of the step's object holding its ``nn.Module`` (for per-layer bisection)."""

    probes: list[str] = field(default_factory=list)
    """Callables called inside a step whose outputs are recorded as fields of the step (they
    show what a step computed even when it later raises)."""

    outputs: list[str] = field(default_factory=list)
    """Names for a step's returned values when it returns a tuple (default: out0, out1, ...)."""

    keyframe_every: int = 50
    """A state keyframe every K steps (fewer when the state is large); 0: only the first."""

    ring: int = 16
    """Full logits of the last N steps, written at exit, when a step raises, and at a lockstep trigger."""

    inputs: Literal["digest", "full"] = "full"
    """Step inputs in full (exact bits, what a re-run feeds) or as digests only."""

    collectives: Literal["digest", "auto", "full"] = "auto"
    """Collective outputs: digests, in full, or in full up to 1 MiB each."""

    durability: Literal["step", "async"] = "step"
    """Only without a record ring (``record_ring_mib = 0``, no ``/dev/shm``, or a CUDA that cannot
    register it): ``step`` returns from a step once it is in the journal (no completed step lost on
    SIGKILL), ``async`` at once (a kill may lose the steps still queued). With the ring, a step is
    durable once its record is in the ring, whatever this says (docs/record.md)."""

    record_ring_mib: int = 64
    """Size of each rank's record ring in ``/dev/shm`` (MiB): the step writes its record there
    and goes on; a drain thread moves it to the journal. 0: no ring (the writer-thread path)."""

    ring_full: Literal["block", "drop"] = "block"
    """When the record ring is full (the drain is behind): ``block`` waits at the step boundary,
    ``drop`` records the step as a gap (a note naming it). ``replay info`` shows both counts."""

    max_bytes: int | None = None
    """Stop recording a rank past this many bytes (the program goes on)."""

    check_lockstep: bool = False
    """Compare output digests across ranks every step, through the process group's store."""

    stop_on_divergence: bool = False
    """With ``check_lockstep``: the step raises ``LockstepDivergence`` at the first mismatch."""

    lockstep_timeout_s: float = 60.0
    """How long a rank waits for the others' digests."""

    cuda_graph_kernels: bool = True
    """Capture CUDA graphs in debug mode to list the kernels inside them."""

    def __post_init__(self) -> None:
        for name, kinds in _TYPES.items():
            _check_type(name, getattr(self, name), kinds)
        for name in ("steps", "graph_capture", "graph_replay", "probes"):
            for target in getattr(self, name):
                if ":" not in target:
                    raise ValueError(f"{target!r} is not of the form module:qualname")
        if self.keyframe_every < 0 or self.ring < 0 or self.record_ring_mib < 0:
            raise ValueError("keyframe_every, ring and record_ring_mib must be >= 0")
        # Checked where settings enter (command line, [tool.replay], the environment), so a bad
        # value is one line before the program starts, never an error inside its step.
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} = {value!r} is not one of: {', '.join(map(str, choices))}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes < 1):
            raise ValueError(f"max_bytes = {self.max_bytes!r} must be a positive integer")

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> "RecordSettings":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def merged(self, **overrides: Any) -> "RecordSettings":
        data = asdict(self)
        for k, v in overrides.items():
            if v is None or v == [] or v == ():
                continue
            if k in ("steps", "graph_capture", "graph_replay", "probes") and data.get(k):
                data[k] = list(dict.fromkeys([*data[k], *v]))
            else:
                data[k] = v
        return RecordSettings(**data)


_LISTS = ("steps", "graph_capture", "graph_replay", "probes", "outputs")
_TYPES: dict[str, tuple[type, ...]] = {
    **{n: (list, tuple) for n in _LISTS},
    **{n: (str, type(None)) for n in ("state", "config", "factory", "tuner", "run_info", "modules")},
    "profile": (str,),
    "keyframe_every": (int,),
    "ring": (int,),
    "record_ring_mib": (int,),
    "max_bytes": (int, type(None)),
    "lockstep_timeout_s": (int, float),
    "check_lockstep": (bool,),
    "stop_on_divergence": (bool,),
    "cuda_graph_kernels": (bool,),
}

_CHOICES: dict[str, tuple[Any, ...]] = {
    "inputs": ("digest", "full"),
    "collectives": ("digest", "auto", "full"),
    "durability": ("step", "async"),
    "ring_full": ("block", "drop"),
    "check_lockstep": (True, False),
    "stop_on_divergence": (True, False),
    "cuda_graph_kernels": (True, False),
}


def _check_type(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if name in _LISTS and ok:
        ok = all(isinstance(x, str) for x in value)
    if not ok:
        want = "a list of strings" if name in _LISTS else " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{name} = {value!r} must be {want}")


def load_pyproject_settings(start: Path) -> dict[str, Any]:
    """The ``[tool.replay]`` table of the nearest pyproject.toml at or above ``start``."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return {}
    for d in [start, *start.parents]:
        p = d / "pyproject.toml"
        if p.is_file():
            try:
                data = tomllib.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{p}: cannot read [tool.replay] ({e})") from None
            table = {k.replace("-", "_"): v for k, v in data.get("tool", {}).get("replay", {}).items()}
            # issue 16: keys read elsewhere: `trusted` by replay/trust.py, `permissions` by replay record
            table = {k: v for k, v in table.items() if k not in ("trusted", "permissions")}
            known = {f.name for f in fields(RecordSettings)}
            unknown = sorted(set(table) - known)
            if unknown:
                raise ValueError(f"{p}: unknown [tool.replay] keys: {', '.join(unknown)}")
            return table
    return {}


def current() -> tuple[Path, RecordSettings] | None:
    """The settings this process was started with by ``replay record``, if any."""
    d = os.environ.get(ENV_DIR)
    s = os.environ.get(ENV_SETTINGS)
    if not d or not s:
        return None
    return Path(d), RecordSettings.from_env(s)
