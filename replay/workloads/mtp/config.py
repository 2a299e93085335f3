"""Model size presets (`ModelArgs`) and run settings (`EngineConfig`) for the MTP reference engine.

`EngineConfig` is the one object a run is described by: the launcher, the CLI and the factory all
take it, and its `to_dict()` form is what a recording stores to rebuild the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["DTYPES", "LAYOUTS", "TUNER_MODES", "EngineConfig", "ModelArgs"]

LAYOUTS = ("replicated", "tp")
TUNER_MODES = ("off", "independent", "broadcast")
DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True, slots=True)
class ModelArgs:
    """Size and numerics of the hybrid attention / recurrent / MoE model with an MTP head."""

    vocab_size: int = 512
    dim: int = 64
    layer_kinds: str = "ara"
    """One letter per layer: ``a`` attention mixer, ``r`` recurrent mixer; every layer has an MoE FFN."""
    n_heads: int = 4
    head_dim: int = 16
    n_experts: int = 8
    top_k: int = 4
    """At least 3, so that the order in which the MoE combine sums its terms changes the bits."""
    expert_dim: int = 128
    state_dim: int = 64
    """Channels of the gated linear recurrence (the Mamba stand-in)."""
    page_size: int = 16
    max_seq_len: int = 1024
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    residual_scale: float = 0.25
    """Scale of the mixers' and the inner MoE layers' outputs against the token embedding: the
    share of context in a prediction. Small values make the target close to a per-token function
    the MTP head imitates (high acceptance, repetitive text); large values make context matter."""
    final_moe_scale: float = 4.0
    """Scale of the last MoE layer's output. The MTP head starts as a copy of that layer, so a
    large value keeps acceptance up while making the MoE combine a large share of the final
    hidden state: that is what lets a combine tactic differing on one rank flip tokens."""
    mtp_context_scale: float = 0.05
    """Weight of the target's hidden state in the MTP head's input projection (the embedding
    part is the identity)."""

    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": {},
        "small": {
            "vocab_size": 32000,
            "dim": 1024,
            "layer_kinds": "arararar",
            "n_heads": 16,
            "head_dim": 64,
            "n_experts": 8,
            "top_k": 4,
            "expert_dim": 1024,
            "state_dim": 1024,
            "page_size": 16,
            "max_seq_len": 2048,
        },
    }

    def __post_init__(self) -> None:
        if not self.layer_kinds or set(self.layer_kinds) - {"a", "r"}:
            raise ValueError(
                f"layer_kinds {self.layer_kinds!r} is invalid; use letters 'a' (attention) and 'r' (recurrent)"
            )
        if not 3 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [3, n_experts={self.n_experts}], got {self.top_k}")
        if self.max_seq_len % self.page_size:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} must be a multiple of page_size {self.page_size}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def pages_per_seq(self) -> int:
        return self.max_seq_len // self.page_size

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelArgs:
        if name not in cls.presets:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(cls.presets)}")
        return cls(**{**cls.presets[name], **overrides})


def _parse_force_tactic(spec: str) -> tuple[int, str, str]:
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].strip().isdigit() or not parts[1] or not parts[2]:
        raise ValueError(f"force_tactic {spec!r} is invalid; write RANK:OP:TACTIC, e.g. 1:moe_combine:bf16")
    return int(parts[0]), parts[1], parts[2]


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything that decides what a run computes. Every drift cause and every fix is a field."""

    preset: str = "tiny"
    """ModelArgs preset: ``tiny`` (CPU tests) or ``small`` (GPU)."""
    seed: int = 0
    """Seeds the weights and the prompts; nothing is downloaded."""
    layout: str = "replicated"
    """``replicated``: every rank runs the whole model on the same batch (the low-latency layout
    where drift bites). ``tp``: column/row sharding with an all-reduce after each mixer and FFN."""
    ranks: int = 1
    """Number of ranks the launcher starts (the engine itself reads rank/world from its caller)."""
    k: int = 3
    """Draft length: tokens the MTP head drafts per decode step."""
    batch: int = 4
    """Number of concurrent requests."""
    prompt_len_min: int = 8
    prompt_len_max: int = 24
    """Prompt lengths are drawn per request in [min, max] from the seed, so requests differ."""
    cudagraph: bool = False
    """Run decode through the bucketed static-buffer runner (CUDA graphs on a GPU)."""
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    """Batch sizes a graph is captured for; a batch is padded up to the next bucket."""
    warmup_iters: int = 3
    """Warm-up runs before each capture; the tuner times its candidates during these."""
    device: str = "cpu"
    dtype: str = "float32"
    max_seq_len: int = 0
    """Longest sequence a request may reach (0: the preset's). A request that reaches it restarts
    with a fresh prompt, a prefill between two decode steps."""
    cpu_threads: int = 1
    """Intra-op threads on CPU, fixed so a re-run in another process computes the same bits."""
    # -- cause 1: per-rank autotuning ------------------------------------------------------------
    tuner: str = "off"
    """``off``: default tactics. ``independent``: each rank times candidates during warm-up and
    keeps its own fastest (the bug). ``broadcast``: rank 0 times and broadcasts (the fix)."""
    tuner_low_precision: bool = False
    """Let the tuner time reduced-precision tactics (bf16 combine) as well."""
    force_tactic: tuple[str, ...] = ()
    """``RANK:OP:TACTIC`` entries forcing a tactic on one rank, e.g. ``1:moe_combine:bf16``."""
    # -- cause 2: nondeterministic kernels -------------------------------------------------------
    nondeterministic_combine: bool = False
    """MoE combine through ``index_add_`` (atomics on a GPU; arrival order drawn from OS entropy
    on CPU, as atomics would)."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True)``; makes the index_add_ combine ordered (fix)."""
    tf32: bool = False
    """Allow TF32 matmuls on CUDA (no effect on CPU)."""
    # -- cause 3: graph hazards (bugs, off by default) -------------------------------------------
    bug_baked_kv_len: bool = False
    """Attention reads only as many KV pages as a host integer says; a graph bakes in the value
    seen at capture."""
    bug_stale_padding: bool = False
    """The graph runner does not reset padded rows of its static buffers: they keep zeros or a
    previous batch's slot ids and pages, so padded rows write real requests' state."""
    # -- cause 4: collectives --------------------------------------------------------------------
    one_shot_allreduce: bool = False
    """TP all-reduce as all-gather plus a local sum starting at the own rank: ranks get different bits."""
    # -- lockstep --------------------------------------------------------------------------------
    broadcast_tokens: bool = False
    """Take rank 0's tokens every step (the usual workaround that hides drift)."""
    lockstep: bool = True
    """All-gather accepted counts every step and raise RankDriftError when ranks disagree."""
    timeout_s: float = 120.0
    """Timeout of the process group's collectives, so a stuck rank fails instead of hanging."""

    def __post_init__(self) -> None:
        if self.preset not in ModelArgs.presets:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(ModelArgs.presets)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {list(LAYOUTS)}")
        if self.tuner not in TUNER_MODES:
            raise ValueError(f"unknown tuner mode {self.tuner!r}; choose one of {list(TUNER_MODES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {list(DTYPES)}")
        if self.max_seq_len < 0:
            raise ValueError(f"max_seq_len must be 0 (preset) or positive, got {self.max_seq_len}")
        for name in ("ranks", "k", "batch", "prompt_len_min", "warmup_iters", "cpu_threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_len_max < self.prompt_len_min:
            raise ValueError(
                f"prompt_len_max {self.prompt_len_max} is below prompt_len_min {self.prompt_len_min}"
            )
        self.buckets = tuple(sorted({int(b) for b in self.buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")
        self.force_tactic = tuple(str(s) for s in self.force_tactic)
        for spec in self.force_tactic:
            _parse_force_tactic(spec)
        self.model_args()  # a bad max_seq_len fails here, not when a rank builds its model

    def model_args(self) -> ModelArgs:
        if self.max_seq_len:
            return ModelArgs.from_preset(self.preset, max_seq_len=self.max_seq_len)
        return ModelArgs.from_preset(self.preset)

    def forced_tactics(self, rank: int) -> dict[str, str]:
        """The ``op -> tactic`` entries of `force_tactic` that apply to ``rank``."""
        forced = {}
        for spec in self.force_tactic:
            r, op, tactic = _parse_force_tactic(spec)
            if r == rank:
                forced[op] = tactic
        return forced

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (tuples become lists); `from_dict` takes it back."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown EngineConfig field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        kwargs: dict[str, Any] = {name: tuple(v) if isinstance(v, list) else v for name, v in d.items()}
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineConfig:
        return EngineConfig.from_dict({**self.to_dict(), **changes})
