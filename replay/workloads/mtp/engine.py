"""The MTP speculative-decoding engine: prefill, then decode steps of draft / verify / accept.

`Engine.decode_step` is the recording boundary. Its arguments are every per-step input, it
mutates only tensors listed by `state_tensors()`, and the lockstep all-gather runs inside it, so a
recorder that wraps it from outside sees a step as tensors in, tensors out, plus collectives.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from replay.workloads.mtp import collectives
from replay.workloads.mtp.attention import ForwardMeta
from replay.workloads.mtp.config import TUNER_MODES, EngineConfig
from replay.workloads.mtp.errors import RankDriftError
from replay.workloads.mtp.graphs import GraphRunner
from replay.workloads.mtp.model import LMHead, Transformer, init_weights
from replay.workloads.mtp.moe import Combine
from replay.workloads.mtp.requests import Request, Scheduler, StepInputs
from replay.workloads.mtp.tp import apply_tp
from replay.workloads.mtp.tuner import Tuner

__all__ = ["Engine", "GenerateResult", "StepInputs", "StepOutput"]

log = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    logits: torch.Tensor
    """[B, k+1, V] logits of the verify forward."""
    tokens: torch.Tensor
    """[B, k+1] int64 accepted tokens, padded with -1."""
    accepted: torch.Tensor
    """[B] int64 tokens emitted this step: accepted drafts + 1."""
    drafts: torch.Tensor
    """[B, k] int64 MTP drafts."""


@dataclass(slots=True)
class GenerateResult:
    steps: int
    prefill_tokens: list[int]
    tokens: list[list[list[int]]] = field(default_factory=list)
    """Per step, per request: the tokens accepted."""
    accepted: list[list[int]] = field(default_factory=list)
    logits_digests: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    graph_steps: int = 0
    eager_steps: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _set_numerics(config: EngineConfig, device: torch.device) -> None:
    # Process-wide switches; the engine owns its process, as a serving rank does.
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    torch.backends.cuda.matmul.allow_tf32 = config.tf32
    torch.backends.cudnn.allow_tf32 = config.tf32
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.are_deterministic_algorithms_enabled() != config.deterministic:
        # Only when it changes: the setter imports torch._dynamo, seconds of a rank's start-up.
        torch.use_deterministic_algorithms(config.deterministic)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        tuner_choices: dict[str, str] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.dtype = getattr(torch, config.dtype)
        self.args = config.model_args()
        self.k = config.k
        _set_numerics(config, self.device)

        model = Transformer(self.args)
        init_weights(model, config.seed)
        if config.layout == "tp":
            apply_tp(model, rank=rank, world_size=world_size, one_shot=config.one_shot_allreduce)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

        n_slots = config.batch + 1  # the last slot is the dummy slot of padded rows
        self.scheduler = Scheduler(config, self.args)
        self.pages = self.scheduler.pages
        self.dummy_slot = n_slots - 1
        self.model.setup_caches(
            n_pages=self.pages.dummy + 1,
            n_slots=n_slots,
            verify_len=self.k + 1,
            dtype=self.dtype,
            device=self.device,
        )
        self.mtp_hidden = torch.zeros(n_slots, self.args.dim, dtype=self.dtype, device=self.device)
        """[slots, D] the target's pre-norm hidden state that produced each request's last token."""

        self.tuner = Tuner(
            config.tuner,
            rank=rank,
            world_size=world_size,
            device=self.device,
            forced={**config.forced_tactics(rank), **(tuner_choices or {})},
            low_precision=config.tuner_low_precision,
        )
        for module in self.model.modules():
            if isinstance(module, (Combine, LMHead)):
                module.tuner = self.tuner
            if isinstance(module, Combine):
                module.atomic = config.nondeterministic_combine
                module.ordered = config.deterministic
        self.graphs = GraphRunner(
            self._draft_and_verify,
            buckets=config.buckets,
            pages_per_seq=self.args.pages_per_seq,
            dummy_slot=self.dummy_slot,
            dummy_page=self.pages.dummy,
            device=self.device,
            tuner=self.tuner,
            warmup_iters=config.warmup_iters,
            kv_pages_of=self._kv_pages,
            stale_padding=config.bug_stale_padding,
            bake_kv_len=config.bug_baked_kv_len,
        )
        self.requests = self.scheduler.requests
        self.step_index = 0
        self.overridden_steps = 0
        """Steps where broadcast_tokens replaced this rank's own tokens with rank 0's."""
        self.last_run_info: dict[str, Any] = {}

    # -- what a debugger reads ------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Live references to every tensor carried from one step to the next."""
        state = {
            name: buf
            for name, buf in self.model.named_buffers()
            if name.rsplit(".", 1)[-1] in ("k_pages", "v_pages", "state", "intermediate")
        }
        state["mtp_hidden"] = self.mtp_hidden
        state.update(self.graphs.state_tensors())
        return state

    def replay_config(self) -> dict[str, Any]:
        return {**self.config.to_dict(), "ranks": self.world_size}

    def tuner_choices(self) -> dict[str, str]:
        return self.tuner.choices()

    def replay_toggles(self) -> dict[str, list[Any]]:
        flags = (
            "cudagraph",
            "deterministic",
            "tf32",
            "tuner_low_precision",
            "nondeterministic_combine",
            "one_shot_allreduce",
            "broadcast_tokens",
            "bug_baked_kv_len",
            "bug_stale_padding",
        )
        toggles: dict[str, list[Any]] = {name: [False, True] for name in flags}
        toggles["tuner"] = list(TUNER_MODES)
        if self.config.force_tactic:
            toggles["force_tactic"] = [[], list(self.config.force_tactic)]
        return toggles

    # -- the decode loop -------------------------------------------------------------------------

    def prefill(self) -> list[int]:
        """Start `config.batch` requests: fill their KV pages and recurrent state from the prompts."""
        if self.requests:
            raise RuntimeError("prefill() already ran on this engine")
        for slot in range(self.config.batch):
            self.requests.append(Request(slot=slot, prompt=self.scheduler.next_prompt()))
            self._prefill_request(self.requests[-1])
        return [r.next_token for r in self.requests]

    def step_inputs(self) -> StepInputs:
        """The tensors of the next decode step, from the host bookkeeping."""
        for req in self.requests:
            if req.pos + self.k + 1 > self.args.max_seq_len:
                self._restart(req)
        return self.scheduler.step_inputs(self.k, self.device)

    @torch.no_grad()
    def decode_step(
        self,
        input_ids: torch.Tensor,
        input_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> StepOutput:
        """Draft k tokens, verify them in one target forward, accept the longest greedy match."""
        logits, drafts, hidden = self._forward(input_ids, input_pos, seq_lens, page_table, slot_ids)
        tokens, accepted = self.accept(logits, drafts)
        tokens, accepted = self._lockstep(tokens, accepted)
        self._commit(slot_ids, accepted, hidden)
        self.step_index += 1
        return StepOutput(logits=logits, tokens=tokens, accepted=accepted, drafts=drafts)

    def draft(self, input_ids: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        return self.model.draft(input_ids, self.mtp_hidden[slot_ids], self.k)

    def verify(self, tokens: torch.Tensor, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the input token and its k drafts: logits [B, k+1, V], hidden."""
        return self.model(tokens, meta)

    def accept(self, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy acceptance: drafts match the target's argmax up to the first miss, plus one bonus."""
        # logits: [B, k+1, V]; drafts: [B, k]
        target = logits.argmax(dim=-1)  # [B, k+1]
        matched = torch.cumprod((drafts == target[:, :-1]).long(), dim=1).sum(dim=1)  # [B]
        accepted = matched + 1
        keep = torch.arange(target.shape[1], device=target.device)[None, :] < accepted[:, None]
        return torch.where(keep, target, torch.full_like(target, -1)), accepted

    def advance(self, out: StepOutput) -> list[list[int]]:
        """Host bookkeeping after a step: positions move by the accepted count."""
        return self.scheduler.advance(out.accepted.tolist(), out.tokens.tolist())

    def capture_graphs(self, buckets: list[int] | None = None) -> None:
        for bucket in buckets if buckets is not None else self.config.buckets:
            if bucket not in self.graphs.captured:
                self.graphs.capture(bucket)

    def generate(
        self, steps: int, *, digests: bool = False, history: GenerateResult | None = None
    ) -> GenerateResult:
        """Prefill (if needed) and run ``steps`` decode steps; ``history`` collects them as they
        complete, so a caller keeps the steps done before a RankDriftError."""
        prefill_tokens = self.prefill() if not self.requests else [r.next_token for r in self.requests]
        result = history if history is not None else GenerateResult(steps=0, prefill_tokens=prefill_tokens)
        result.prefill_tokens = prefill_tokens
        bucket = self.graphs.bucket_for(len(self.requests))
        if self.config.cudagraph and bucket is not None:
            self.capture_graphs([bucket])  # capture is not decode time
        start = time.perf_counter()
        try:
            for _ in range(steps):
                out = self.decode_step(*self.step_inputs())
                result.tokens.append(self.advance(out))
                result.accepted.append(out.accepted.tolist())
                if digests:
                    result.logits_digests.append(_digest(out.logits))
                result.steps += 1
                if self.last_run_info["mode"] == "graph":
                    result.graph_steps += 1
                else:
                    result.eager_steps += 1
        finally:
            result.elapsed_s = time.perf_counter() - start
        return result

    # -- internals -------------------------------------------------------------------------------

    def _forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = inputs[0].shape[0]
        bucket = self.graphs.bucket_for(batch)
        if not self.config.cudagraph:
            reason = "cudagraph off"
        elif bucket is None:
            reason = f"batch {batch} exceeds largest bucket {self.graphs.buckets[-1]}"
        else:
            if bucket not in self.graphs.captured:
                self.graphs.capture(bucket)
            logits, drafts, hidden = self.graphs.replay(bucket, *inputs)
            self.last_run_info = {"mode": "graph", "key": f"bs{bucket}", "padded_size": bucket, "reason": ""}
            if self.device.type == "cuda":
                # Graph outputs live in static memory the next replay overwrites.
                logits, drafts = logits.clone(), drafts.clone()
            return logits, drafts, hidden
        self.last_run_info = {"mode": "eager", "key": f"eager{batch}", "padded_size": batch, "reason": reason}
        kv_pages = self._kv_pages(inputs[2]) if self.config.bug_baked_kv_len else None
        return self._draft_and_verify(*inputs, kv_pages=kv_pages)

    def _draft_and_verify(
        self, *inputs: torch.Tensor, kv_pages: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The part a CUDA graph captures: logits [B, k+1, V], drafts [B, k], hidden [B, k+1, D]."""
        input_ids, input_pos, _seq_lens, page_table, slot_ids = inputs
        drafts = self.draft(input_ids, slot_ids)
        tokens = torch.cat([input_ids[:, None], drafts], dim=1)  # [B, k+1]
        positions = input_pos[:, None] + torch.arange(self.k + 1, device=input_pos.device)  # [B, k+1]
        meta = ForwardMeta(
            input_pos=positions, page_table=page_table, slot_ids=slot_ids, verify=True, kv_pages=kv_pages
        )
        logits, hidden = self.verify(tokens, meta)
        return logits, drafts, hidden

    def _kv_pages(self, seq_lens: torch.Tensor) -> int:
        # A host read of the longest sequence: fine eagerly, frozen at its capture value in a graph.
        longest = int(seq_lens.max()) + self.k + 1 if seq_lens.numel() else self.k + 1
        return min(math.ceil(longest / self.args.page_size), self.args.pages_per_seq)

    def _lockstep(self, tokens: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.world_size == 1:
            return tokens, accepted
        if self.config.broadcast_tokens:
            packed = torch.cat([accepted[:, None], tokens], dim=1)  # [B, k+2]
            own = packed.clone()
            collectives.broadcast_(packed, src=0)
            if not torch.equal(own, packed):
                self.overridden_steps += 1
            accepted, tokens = packed[:, 0].contiguous(), packed[:, 1:].contiguous()
        if self.config.lockstep:
            counts = collectives.all_gather_rows(accepted).tolist()  # [world, B]
            if any(c != counts[0] for c in counts):
                raise RankDriftError(self.step_index, RankDriftError.odd_ranks(counts), counts)
        return tokens, accepted

    def _commit(self, slot_ids: torch.Tensor, accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        last = accepted - 1  # [B] index of the last accepted input position in the verify
        for rec in self.model.recurrent_layers():
            rec.commit(slot_ids, last)
        self.mtp_hidden[slot_ids] = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]

    def _restart(self, req: Request) -> None:
        """A request that reached max_seq_len restarts with a fresh prompt in the same slot."""
        # This prefill changes state between two decode steps, outside the recording boundary.
        log.info(
            "rank %d step %d: slot %d reached max_seq_len; restarting it",
            self.rank,
            self.step_index,
            req.slot,
        )
        self.scheduler.restart(req)
        self._prefill_request(req)

    @torch.no_grad()
    def _prefill_request(self, req: Request) -> None:
        length = len(req.prompt)
        if length + self.k + 1 > self.args.max_seq_len:
            raise ValueError(f"prompt of {length} tokens does not fit max_seq_len {self.args.max_seq_len}")
        table = self.scheduler.page_table([req], upto=[length])
        slot = torch.tensor([req.slot], device=self.device)
        for rec in self.model.recurrent_layers():
            rec.state[slot] = 0  # a reused slot must not carry the old request
        meta = ForwardMeta(
            input_pos=torch.arange(length, device=self.device)[None, :],
            page_table=table.to(self.device),
            slot_ids=slot,
            verify=False,
        )
        logits, hidden = self.model(torch.tensor([req.prompt], device=self.device), meta)
        self.mtp_hidden[slot] = hidden[:, -1]
        req.pos = length
        req.next_token = int(logits[0, -1].argmax())
        req.generated = [req.next_token]
