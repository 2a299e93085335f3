"""``HFDecoder``: a small user-style engine around a Hugging Face causal LM with a static KV cache.

It is written the way a user wraps their own model, with nothing in it for ``replay``'s sake
beyond four small accessors a recorder needs to rebuild it (see README.md, "The recipe"):

- ``decode_step(input_ids, cache_position, cache) -> logits``: one greedy decode step, the unit
  ``replay record --step`` records;
- ``replay_state()``: every tensor of the static KV cache (what a keyframe must restore);
- ``replay_config()``: the JSON config the factory rebuilds the engine from;
- ``build(config, *, rank, world_size, device, options)``: the factory.

Decoding runs eagerly, under one CUDA graph captured by hand around the decode step
(``graphs="manual"``), or through ``torch.compile(mode="reduce-overhead")`` (``graphs="compile"``);
on one rank or tensor-parallel over several (``tp=True``; the caller owns the process group).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from examples.hf_llama.model import PRESETS, apply_tensor_parallel, make_model

__all__ = ["DecoderConfig", "HFDecoder", "build", "GRAPH_MODES"]

GRAPH_MODES = ("none", "manual", "compile")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True)
class DecoderConfig:
    preset: str = "tiny"
    """A model size from ``examples.hf_llama.model.PRESETS``."""
    seed: int = 0
    """Seed of the weights and of the prompt (the same on every rank)."""
    dtype: str = "float32"
    batch: int = 2
    prompt_len: int = 4
    tp: bool = False
    """Shard the model over the ranks of the process group (tensor parallelism)."""
    graphs: str = "none"
    """none: eager; manual: one CUDA graph captured around the decode step; compile: reduce-overhead."""
    attn: str = "sdpa"
    perturb_rank: int | None = None
    """A planted bug: this rank's ``perturb_module`` weight is changed from ``perturb_at`` on."""
    perturb_at: int = 0
    """The decode step (0 = the first after prefill) from which ``perturb_rank`` is perturbed."""
    perturb_module: str = "model.norm"
    perturb_scale: float = 1e-2

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; one of {', '.join(PRESETS)}")
        if self.graphs not in GRAPH_MODES:
            raise ValueError(f"graphs={self.graphs!r}; one of {', '.join(GRAPH_MODES)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; one of {', '.join(_DTYPES)}")
        if self.batch < 1 or self.prompt_len < 1:
            raise ValueError("batch and prompt_len must be at least 1")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class HFDecoder:
    """Greedy decoding of a ``LlamaForCausalLM`` with a ``StaticCache``, on one rank of ``world_size``."""

    def __init__(self, config: DecoderConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu") -> None:
        from transformers import StaticCache

        self.config = config
        self.rank, self.world_size, self.device = rank, world_size, device
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # before any device mesh: this rank's GPU, not a guess
        self.preset = PRESETS[config.preset]
        p = self.preset
        self.model = make_model(p, seed=config.seed, dtype=_DTYPES[config.dtype], device=device, attn=config.attn)
        if config.tp and world_size > 1:
            if p.heads % world_size or p.kv_heads % world_size:
                raise ValueError(f"{p.heads} heads / {p.kv_heads} KV heads do not split over {world_size} ranks")
            apply_tensor_parallel(self.model, world_size, device)
        kv_heads = p.kv_heads // world_size if config.tp else p.kv_heads
        head_dim = p.hidden // p.heads
        self.cache = StaticCache(config=self.model.config, max_cache_len=p.max_len)
        # Allocated now, not at the first update: the cache's tensors are the state a re-run
        # restores, and a CUDA graph must see their final addresses.
        self.cache.early_initialization(config.batch, kv_heads, head_dim, _DTYPES[config.dtype], torch.device(device))
        # The model's keyword for the cache and whether it takes cache_position differ between
        # transformers versions (past_key_values / cache).
        fwd = self.model.forward
        self._cache_kw = "cache" if _accepts(fwd, "cache") else "past_key_values"
        self._pass_cache_position = _accepts(fwd, "cache_position")
        self._kv_index = torch.arange(p.max_len, device=device)  # key positions, for the mask
        self._perturbed = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._compiled: Any = None
        self.last_run_info: dict[str, Any] = {"mode": "eager", "key": ""}

    # -- what replay reads -------------------------------------------------------------------

    def replay_config(self) -> dict[str, Any]:
        return asdict(self.config)

    def replay_state(self) -> dict[str, torch.Tensor]:
        """Every tensor the static cache holds (keys, values and, in newer transformers, its length)."""
        return {
            f"cache.{i}.{name}": t
            for i, layer in enumerate(self.cache.layers)
            for name, t in vars(layer).items()
            if isinstance(t, torch.Tensor)
        }

    def replay_toggles(self) -> dict[str, list[Any]]:
        # The engine has its own graph runner on a GPU: a cudagraph re-run uses it.
        return {"cudagraph": [False, True]} if self.device.startswith("cuda") else {}

    # -- the model call ----------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits of the last position. input_ids: [B, S]; position: [S] (absolute positions)."""
        b, s = input_ids.shape
        position_ids = position.unsqueeze(0).expand(b, s)  # [B, S]
        # A ready 4-D mask: no host-side mask logic, so the call can be captured in a graph.
        mask = self._kv_index.unsqueeze(0) <= position.unsqueeze(-1)  # [S, L]
        kwargs: dict[str, Any] = {self._cache_kw: cache}
        if self._pass_cache_position:
            kwargs["cache_position"] = position
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask[None, None].expand(b, 1, s, mask.shape[-1]),  # [B, 1, S, L]
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1, :]  # [B, V]

    def _maybe_perturb(self, cache_position: torch.Tensor) -> None:
        c = self.config
        if c.perturb_rank != self.rank or self._perturbed:
            return
        if int(cache_position[0]) >= c.prompt_len + c.perturb_at:  # host sync: the planted bug only
            module = self.model.get_submodule(c.perturb_module)
            with torch.no_grad():
                module.weight.add_(c.perturb_scale)  # in place: a captured graph sees it too
            self._perturbed = True

    # -- graphs ------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.replay_state().items()}

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        live = self.replay_state()
        for k, v in saved.items():
            live[k].copy_(v)

    def capture_graphs(self, warmup: int = 3) -> None:
        """Capture the decode step (manual) or compile and warm it up (compile); state unchanged."""
        mode = self.config.graphs
        if mode == "none" or self._graph is not None or self._compiled is not None:
            return
        if not self.device.startswith("cuda"):
            raise ValueError(f"graphs={mode!r} needs a CUDA device")
        saved = self._snapshot()
        ids = torch.zeros(self.config.batch, 1, dtype=torch.long, device=self.device)
        pos = torch.full((1,), self.config.prompt_len, dtype=torch.long, device=self.device)
        if mode == "manual":
            self._static = {"input_ids": ids, "cache_position": pos}
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(warmup):
                    self._forward(ids, pos, self.cache)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._static["logits"] = self._forward(ids, pos, self.cache)
            self._graph = g
        else:
            self._compiled = torch.compile(self._forward, mode="reduce-overhead", fullgraph=False)
            for _ in range(warmup):
                torch.compiler.cudagraph_mark_step_begin()
                self._compiled(ids, pos, self.cache)
        torch.cuda.synchronize()
        self._restore(saved)

    # -- decoding ----------------------------------------------------------------------------

    def prompt(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.config.seed + 1)
        return torch.randint(self.preset.vocab, (self.config.batch, self.config.prompt_len), generator=g).to(self.device)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Fill the cache with the prompt (eagerly); the first token. prompt: [B, P]."""
        position = torch.arange(prompt.shape[1], device=self.device)
        return self._forward(prompt, position, self.cache).argmax(-1, keepdim=True)  # [B, 1]

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, cache_position: torch.Tensor, cache: Any) -> torch.Tensor:
        """One token per sequence. input_ids: [B, 1]; cache_position: [1]; returns logits [B, V]."""
        self._maybe_perturb(cache_position)
        if self._graph is not None and cache is self.cache:
            self._static["input_ids"].copy_(input_ids)
            self._static["cache_position"].copy_(cache_position)
            self._graph.replay()
            self.last_run_info = {"mode": "graph", "key": "decode"}
            return self._static["logits"]
        if self._compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            self.last_run_info = {"mode": "graph", "key": "compile"}
            # The output lives in the graph's pool, overwritten by the next call: hand out a copy.
            return self._compiled(input_ids, cache_position, cache).clone()
        self.last_run_info = {"mode": "eager", "key": ""}
        return self._forward(input_ids, cache_position, cache)

    def generate(self, steps: int) -> torch.Tensor:
        """Greedy decoding of ``steps`` tokens after the prompt; the tokens, [B, steps]."""
        self.capture_graphs()
        tok = self.prefill(self.prompt())
        out = []
        for s in range(steps):
            pos = torch.tensor([self.config.prompt_len + s], device=self.device)
            logits = self.decode_step(tok, pos, self.cache)
            tok = logits.argmax(-1, keepdim=True)  # [B, 1]
            out.append(tok)
        return torch.cat(out, dim=1)


def build(config: dict[str, Any], *, rank: int, world_size: int, device: str, options: dict[str, Any]) -> HFDecoder:
    """The factory ``replay`` rebuilds the engine with (any process group already exists)."""
    cfg = DecoderConfig.from_json(config)
    data = asdict(cfg)
    data.update({k: v for k, v in options.items() if k in data})
    if "cudagraph" in options:
        # Re-run under a CUDA graph: keep the recorded way of graphing, or graph by hand.
        if not options["cudagraph"]:
            data["graphs"] = "none"
        elif data["graphs"] == "none":
            data["graphs"] = "manual"
    return HFDecoder(DecoderConfig(**data), rank=rank, world_size=world_size, device=device)
