"""Small synthetic recordings for tests: real files written by the real recorder."""

from __future__ import annotations

from pathlib import Path

import torch

from replay import Recorder, RecorderConfig

VOCAB = 32


def step_inputs(step: int, batch: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, 1), generator=g),
        "input_pos": torch.full((batch,), step, dtype=torch.int32),
        "hidden": torch.randn(batch, 8, generator=g).to(torch.bfloat16),
    }


def step_logits(step: int, batch: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, VOCAB, generator=g)


def make_recording(
    tmp_path: Path,
    *,
    ranks: int = 4,
    steps: int = 10,
    diverge_at: int | None = None,
    diverge_rank: int = 2,
    field: str = "output",
    part: str = "run-000",
    keyframe_every: int = 0,
    ring: int = 0,
    name: str = "rec",
) -> Path:
    """A recording of ``ranks`` ranks; from step ``diverge_at`` on, ``diverge_rank`` differs.

    ``field``: "output" perturbs one logit bit (tokens stay the same), "tokens" also flips the
    sampled token, "input" perturbs an input.
    """
    out = tmp_path / name
    for r in range(ranks):
        state = {"kv": torch.zeros(2, 3)}
        rec = Recorder(
            RecorderConfig(out=out, part=part, rank=r, world_size=ranks, keyframe_every=keyframe_every, ring=ring),
            state_fn=lambda: state,
        )
        for s in range(steps):
            rec.begin_step()
            inputs = step_inputs(s)
            odd = r == diverge_rank and diverge_at is not None and s >= diverge_at
            if odd and field == "input":
                inputs["input_ids"] = inputs["input_ids"] + 1
            rec.record_inputs(**inputs)
            logits = step_logits(s)
            if odd and field in ("output", "tokens"):
                logits.view(torch.int32)[0, 0] ^= 1
            tokens = logits.argmax(-1)
            if odd and field == "tokens":
                tokens = (tokens + 1) % VOCAB
            state["kv"] += 1
            rec.record_outputs(logits=logits, tokens=tokens, accepted=torch.ones(4, dtype=torch.int64))
            rec.set_run("graph" if s % 2 == 0 else "eager", key="bs4", padded_size=4, reason="" if s % 2 == 0 else "test")
            rec.end_step()
        rec.close()
        assert rec.error is None, rec.error
    return out
