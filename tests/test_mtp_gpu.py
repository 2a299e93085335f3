"""The MTP reference engine on real GPUs: CUDA graphs, timed tuning, atomics, NCCL.

Skipped without CUDA; two-rank tests also need two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from replay.workloads.mtp.config import EngineConfig
from replay.workloads.mtp.engine import Engine, GenerateResult
from replay.workloads.mtp.launch import run_many

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def run_steps(steps: int, **overrides: object) -> tuple[Engine, GenerateResult]:
    engine = Engine(EngineConfig(device="cuda", **overrides), device="cuda")  # type: ignore[arg-type]
    return engine, engine.generate(steps, digests=True)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cuda_graph_matches_eager(preset: str) -> None:
    _, eager = run_steps(16, preset=preset)
    engine, graph = run_steps(16, preset=preset, cudagraph=True)
    # A real graph was captured.
    assert isinstance(engine.graphs._graphs[4], torch.cuda.CUDAGraph)
    assert graph.graph_steps == 16 and eager.eager_steps == 16
    assert graph.tokens == eager.tokens


def test_graph_outputs_survive_the_next_replay() -> None:
    engine, _ = run_steps(2, cudagraph=True)
    first = engine.decode_step(*engine.step_inputs())
    kept = first.logits.clone()
    engine.advance(first)
    engine.decode_step(*engine.step_inputs())
    # StepOutput holds copies, not static graph memory.
    assert torch.equal(first.logits, kept)


def test_unsynchronized_tuning_times_real_kernels() -> None:
    engine, result = run_steps(4, preset="small", cudagraph=True, tuner="independent")
    choices = engine.tuner_choices()
    assert {"moe_combine.m16", "lm_head.m16", "moe_combine.m4", "lm_head.m4"} <= set(choices)
    timings = engine.tuner.timings["moe_combine.m16"]
    assert set(timings) == {"sum", "bmm", "tree", "reverse"} and all(t > 0 for t in timings.values())
    assert choices["moe_combine.m16"] == min(timings, key=timings.__getitem__)
    assert result.graph_steps == 4


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_index_add_combine_nondeterminism(deterministic: bool) -> None:
    engine, _ = run_steps(2, preset="small", nondeterministic_combine=True, deterministic=deterministic)
    inputs = engine.step_inputs()
    snap = {n: t.clone() for n, t in engine.state_tensors().items()}
    digests = set()
    for _ in range(20):
        for n, t in engine.state_tensors().items():
            t.copy_(snap[n])
        moe_out: list[torch.Tensor] = []
        hook = engine.model.blocks()[0].moe.combine.register_forward_hook(
            lambda m, a, out, sink=moe_out: sink.append(out.clone())
        )
        engine.decode_step(*inputs)
        hook.remove()
        digests.add(b"".join(o.cpu().numpy().tobytes() for o in moe_out))
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    assert (len(digests) == 1) == deterministic


@pytest.mark.multigpu
@two_gpus
def test_nccl_two_ranks() -> None:
    base = EngineConfig(device="cuda", cudagraph=True)
    clean, drift, tp = run_many(
        [base, base.replace(seed=6, batch=8, force_tactic=["1:moe_combine:bf16"]), base.replace(layout="tp")],
        ranks=2,
        steps=24,
        digests=True,
        timeout_s=300,
    )
    for r in clean + tp:
        assert r.error is None and r.steps == 24 and r.graph_steps == 24
    assert clean[0].tokens == clean[1].tokens and clean[0].logits_digests == clean[1].logits_digests
    # NCCL all-reduce inside the captured graph: the same bits on both ranks.
    assert tp[0].logits_digests == tp[1].logits_digests
    assert all(r.error_type == "RankDriftError" and r.drift_ranks == [1] for r in drift)
