"""The MTP reference engine on CPU: lockstep, graph runner, re-runs, and every drift cause.

Multi-rank scenarios share one set of spawned processes per world size (`launch.run_many`), since
starting a rank costs more than running a few dozen tiny steps.
"""

from __future__ import annotations

import json
import math
import os
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from replay.workloads.mtp.__main__ import EXIT_DRIFT, main
from replay.workloads.mtp.attention import ForwardMeta
from replay.workloads.mtp.config import EngineConfig, ModelArgs
from replay.workloads.mtp.engine import Engine, GenerateResult, StepOutput
from replay.workloads.mtp.errors import RankDriftError
from replay.workloads.mtp.factory import build_engine
from replay.workloads.mtp import launch
from replay.workloads.mtp.launch import RankResult, run_many

DRIFT = "1:moe_combine:bf16"
"""A tactic forced on rank 1 only: reduced-precision MoE combine (the drift configuration)."""
FAST_DRIFT: dict[str, Any] = {"seed": 6, "batch": 8}
"""A run that drifts within a few steps under a forced bf16 combine (CPU runs are deterministic)."""


@pytest.fixture(autouse=True)
def _restore_torch_settings() -> Iterator[None]:
    # Engines set process-wide numerics (threads, deterministic algorithms); other tests share
    # this process. Per test, so that `pytest -n` can spread this module's tests.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        torch.use_deterministic_algorithms(deterministic)


def make_engine(**overrides: object) -> Engine:
    return Engine(EngineConfig(**overrides))  # type: ignore[arg-type]


def run_steps(steps: int = 6, **overrides: object) -> tuple[Engine, GenerateResult]:
    engine = make_engine(**overrides)
    return engine, engine.generate(steps, digests=True)


def snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.state_tensors().items()}


def restore(engine: Engine, snap: dict[str, torch.Tensor]) -> None:
    for name, t in engine.state_tensors().items():
        t.copy_(snap[name])


# -- configuration --------------------------------------------------------------------------------


def test_presets() -> None:
    tiny, small = ModelArgs.from_preset("tiny"), ModelArgs.from_preset("small")
    assert tiny.dim < small.dim and small.vocab_size == 32000 and small.n_layers == 8
    assert set(tiny.layer_kinds) == {"a", "r"}
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelArgs.from_preset("huge")


def test_config_round_trip_is_json_safe() -> None:
    cfg = EngineConfig(layout="tp", ranks=2, cudagraph=True, buckets=(8, 2), force_tactic=(DRIFT,))
    d = json.loads(json.dumps(cfg.to_dict()))
    assert EngineConfig.from_dict(d) == cfg
    assert d["buckets"] == [2, 8]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1}, "unknown EngineConfig field"),
        ({"layout": "ring"}, "unknown layout"),
        ({"tuner": "fast"}, "unknown tuner mode"),
        ({"force_tactic": ["moe_combine:bf16"]}, "RANK:OP:TACTIC"),
        ({"k": 0}, "k must be at least 1"),
    ],
    ids=["unknown-key", "layout", "tuner", "force-tactic", "k"],
)
def test_config_rejects_bad_values(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict({**EngineConfig().to_dict(), **change})


def test_unknown_forced_tactic_is_rejected() -> None:
    with pytest.raises(ValueError, match="tactics of moe_combine are"):
        make_engine(force_tactic=("0:moe_combine:fastest",))


# -- one rank: decoding ---------------------------------------------------------------------------


def test_step_output_shapes_and_acceptance() -> None:
    engine, result = run_steps(20)
    cfg, vocab = engine.config, engine.args.vocab_size
    out = engine.decode_step(*engine.step_inputs())
    assert isinstance(out, StepOutput)
    assert out.logits.shape == (cfg.batch, cfg.k + 1, vocab)
    assert out.tokens.shape == (cfg.batch, cfg.k + 1) and out.drafts.shape == (cfg.batch, cfg.k)
    for row, n in zip(out.tokens.tolist(), out.accepted.tolist()):
        assert 1 <= n <= cfg.k + 1
        assert all(0 <= t < vocab for t in row[:n]) and all(t == -1 for t in row[n:])
    drafted = result.steps * cfg.batch * cfg.k
    rate = (sum(map(sum, result.accepted)) - result.steps * cfg.batch) / drafted
    assert 0.2 < rate < 0.95, f"acceptance {rate:.2f} is not meaningful"


def test_speculative_tokens_equal_greedy_decoding() -> None:
    """Greedy speculative decoding must emit exactly the target's greedy tokens: a check of
    acceptance, positions, KV pages and the recurrent-state rollback together."""
    engine, _ = run_steps(12)
    checker = make_engine()
    for slot, req in enumerate(engine.requests[:2]):  # fresh slots: their recurrent state is zero
        seq = req.prompt + req.generated
        n_pages = math.ceil(len(seq) / engine.args.page_size)
        table = torch.full((1, engine.args.pages_per_seq), checker.pages.dummy, dtype=torch.int64)
        table[0, :n_pages] = torch.tensor([checker.pages.take() for _ in range(n_pages)])
        meta = ForwardMeta(
            input_pos=torch.arange(len(seq) - 1)[None],
            page_table=table,
            slot_ids=torch.tensor([slot]),
            verify=False,
        )
        logits, _ = checker.model(torch.tensor([seq[:-1]]), meta)
        greedy = logits[0].argmax(-1).tolist()[len(req.prompt) - 1 :]
        assert greedy == req.generated
        checker.pages.give_back(table[0, :n_pages].tolist())


@pytest.mark.parametrize("batch", [4, 3], ids=["full-bucket", "padded"])
def test_graph_runner_matches_eager(batch: int) -> None:
    _, eager = run_steps(8, batch=batch)
    engine, graph = run_steps(8, batch=batch, cudagraph=True)
    assert graph.graph_steps == 8 and eager.eager_steps == 8
    assert graph.tokens == eager.tokens
    if batch == 4:  # same shapes on both paths: the same bits on CPU
        assert graph.logits_digests == eager.logits_digests
    assert engine.last_run_info == {"mode": "graph", "key": "bs4", "padded_size": 4, "reason": ""}


@pytest.mark.parametrize(
    ("overrides", "info"),
    [
        ({"batch": 2}, {"mode": "graph", "key": "bs2", "padded_size": 2, "reason": ""}),
        ({"batch": 5}, {"mode": "graph", "key": "bs8", "padded_size": 8, "reason": ""}),
        (
            {"batch": 9},
            {
                "mode": "eager",
                "key": "eager9",
                "padded_size": 9,
                "reason": "batch 9 exceeds largest bucket 8",
            },
        ),
        (
            {"batch": 3, "cudagraph": False},
            {"mode": "eager", "key": "eager3", "padded_size": 3, "reason": "cudagraph off"},
        ),
    ],
    ids=["exact-bucket", "pad-5-to-8", "beyond-largest", "cudagraph-off"],
)
def test_bucket_choice(overrides: dict[str, object], info: dict[str, object]) -> None:
    engine = make_engine(**{"cudagraph": True, **overrides})
    engine.prefill()
    engine.decode_step(*engine.step_inputs())
    assert engine.last_run_info == info
    assert sorted(engine.graphs.captured) == ([info["padded_size"]] if info["mode"] == "graph" else [])


def test_padded_rows_touch_only_the_dummy_slot_and_page() -> None:
    engine = make_engine(batch=3, cudagraph=True)
    engine.prefill()
    before = snapshot(engine)
    engine.decode_step(*engine.step_inputs())
    static = engine.graphs.static
    assert static["slot_ids"][3].item() == engine.dummy_slot
    assert (static["page_table"][3] == engine.pages.dummy).all()
    # Slot 3 exists only as padding; the real slots 0..2 changed, the unused slot 3 did not.
    state = engine.state_tensors()["layers.1.recurrent.state"]
    assert torch.equal(state[engine.dummy_slot], before["layers.1.recurrent.state"][engine.dummy_slot])


@pytest.mark.parametrize("cudagraph", [False, True], ids=["eager", "graph"])
def test_rerun_from_snapshot_is_bitwise(cudagraph: bool) -> None:
    engine, _ = run_steps(4, cudagraph=cudagraph, batch=3)
    inputs = engine.step_inputs()
    snap = snapshot(engine)
    first = engine.decode_step(*inputs)
    after = snapshot(engine)
    restore(engine, snap)
    second = engine.decode_step(*inputs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert all(torch.equal(after[n], t) for n, t in engine.state_tensors().items())


def test_state_tensors_are_live_references() -> None:
    engine = make_engine()
    state = engine.state_tensors()
    assert state["mtp_hidden"] is engine.mtp_hidden
    cache = engine.model.attention_layers()[0].kv_cache
    assert cache is not None and state["layers.0.attn.kv_cache.k_pages"] is cache.k_pages
    assert {"layers.1.recurrent.state", "layers.1.recurrent.intermediate", "graphs.slot_ids"} <= set(state)


def test_module_names_and_taps_inside_graph_runner() -> None:
    engine = make_engine(cudagraph=True)
    names = dict(engine.model.named_modules())
    for name in (
        "layers.0.attn",
        "layers.0.moe",
        "layers.0.moe.combine",
        "layers.1.recurrent",
        "norm",
        "lm_head",
        "mtp",
    ):
        assert name in names
    seen: list[tuple[int, ...]] = []
    names["layers.0.moe.combine"].register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    engine.generate(1)  # capture happens after the hook is installed
    assert (4 * (engine.k + 1), engine.args.dim) in seen


# -- drift causes, one rank -----------------------------------------------------------------------


@pytest.mark.parametrize("tactic", ["tree", "reverse", "bf16"])
def test_combine_tactics_change_bits(tactic: str) -> None:
    _, ref = run_steps(3)
    _, forced = run_steps(3, force_tactic=(f"0:moe_combine:{tactic}",))
    assert forced.logits_digests != ref.logits_digests


@pytest.mark.parametrize("bug", ["bug_stale_padding", "bug_baked_kv_len"])
def test_graph_hazards_change_graph_results_only(bug: str) -> None:
    _, clean_graph = run_steps(6, batch=3, cudagraph=True)
    _, buggy_graph = run_steps(6, batch=3, cudagraph=True, **{bug: True})
    _, buggy_eager = run_steps(6, batch=3, cudagraph=False, **{bug: True})
    assert buggy_graph.logits_digests[0] != clean_graph.logits_digests[0]
    assert buggy_graph.tokens != clean_graph.tokens
    # The hazard lives in the graph runner only.
    assert buggy_eager.tokens == clean_graph.tokens


def test_stale_padding_writes_a_real_slot() -> None:
    engine = make_engine(batch=3, cudagraph=True, bug_stale_padding=True)
    engine.generate(1)
    # The padded row points at request 0's slot.
    assert engine.graphs.static["slot_ids"][3].item() == 0


def test_baked_kv_len_is_frozen_at_capture() -> None:
    engine = make_engine(cudagraph=True, bug_baked_kv_len=True)
    engine.generate(2)
    assert engine.graphs.captured[4] == 1  # capture saw the dummy batch: one page
    assert engine._kv_pages(engine.step_inputs().seq_lens) > 1


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_index_add_combine_repeatability(deterministic: bool) -> None:
    engine, _ = run_steps(2, nondeterministic_combine=True, deterministic=deterministic)
    inputs, snap = engine.step_inputs(), snapshot(engine)
    logits = []
    for _ in range(4):
        restore(engine, snap)
        logits.append(engine.decode_step(*inputs).logits)
    same = all(torch.equal(logits[0], other) for other in logits[1:])
    # Process-wide: do not leak into later tests.
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    assert same == deterministic


def test_independent_tuner_times_during_capture() -> None:
    engine, _ = run_steps(2, cudagraph=True, tuner="independent")
    choices = engine.tuner_choices()
    assert {"moe_combine.m16", "moe_combine.m4", "lm_head.m16", "lm_head.m4"} <= set(choices)
    assert set(engine.tuner.timings["moe_combine.m16"]) == {"sum", "bmm", "tree", "reverse"}
    eager, _ = run_steps(2, cudagraph=False, tuner="independent")
    assert eager.tuner_choices() == {}  # nothing is tuned outside a capture


def test_factory_rebuilds_with_forced_choices() -> None:
    engine, _ = run_steps(3, cudagraph=True, tuner="independent")
    inputs, snap = engine.step_inputs(), snapshot(engine)
    out = engine.decode_step(*inputs)
    choices = {**engine.tuner_choices(), "moe_combine": "reverse"}
    rebuilt = build_engine(
        engine.replay_config(), rank=0, world_size=1, device="cpu", options={"tuner_choices": choices}
    )
    assert rebuilt.tuner_choices()["moe_combine"] == "reverse"
    same = build_engine(
        engine.replay_config(),
        rank=0,
        world_size=1,
        device="cpu",
        options={"tuner_choices": engine.tuner_choices()},
    )
    restore(same, snap)
    assert torch.equal(same.decode_step(*inputs).logits, out.logits)
    toggled = build_engine(
        engine.replay_config(), rank=0, world_size=1, device="cpu", options={"cudagraph": False}
    )
    assert toggled.config.cudagraph is False
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        build_engine(engine.replay_config(), rank=0, world_size=1, device="cpu", options={"nope": 1})


def test_replay_toggles() -> None:
    toggles = make_engine(force_tactic=(DRIFT,)).replay_toggles()
    for name in (
        "cudagraph",
        "deterministic",
        "tf32",
        "nondeterministic_combine",
        "one_shot_allreduce",
        "broadcast_tokens",
        "bug_baked_kv_len",
        "bug_stale_padding",
    ):
        assert toggles[name] == [False, True]
    assert toggles["tuner"] == ["off", "independent", "broadcast"]
    assert toggles["force_tactic"] == [[], [DRIFT]]
    assert json.loads(json.dumps(toggles)) == toggles


def test_rank_drift_error_names_step_and_odd_rank() -> None:
    counts = [[1, 2], [1, 2], [1, 3], [1, 2]]
    err = RankDriftError(7, RankDriftError.odd_ranks(counts), counts)
    assert err.ranks == [2] and "decode step 7" in str(err) and "rank 2 accepted [1, 3]" in str(err)
    assert RankDriftError.odd_ranks([[1], [2]]) == [1]


# -- several ranks --------------------------------------------------------------------------------

STEPS = 24
TWO_RANK = {
    "clean": EngineConfig(cudagraph=True),
    "drift": EngineConfig(cudagraph=True, force_tactic=(DRIFT,)),
    "drift-tp": EngineConfig(cudagraph=True, layout="tp", force_tactic=(DRIFT,)),
    "drift-broadcast": EngineConfig(cudagraph=True, force_tactic=(DRIFT,), broadcast_tokens=True),
    "tuner-broadcast": EngineConfig(cudagraph=True, tuner="broadcast"),
}
FOUR_RANK = {
    "tp": EngineConfig(layout="tp"),
    "tp-one-shot": EngineConfig(layout="tp", one_shot_allreduce=True),
    "drift-rank2": EngineConfig(**FAST_DRIFT, force_tactic=("2:moe_combine:bf16",)),
}


SITECUSTOMIZE = """
import os, pathlib
pathlib.Path(os.environ["MTP_TEST_MARKERS"], f"pid-{os.getpid()}").touch()
"""


@dataclass
class SpawnedRun:
    results: dict[str, list[RankResult]]
    started: list[str]
    """One marker per Python process that ran the injected sitecustomize."""


class _Exited:
    """A rank process that has ended (as ``multiprocessing.Process`` shows it)."""

    def __init__(self, exitcode: int | None) -> None:
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return False


def test_run_many_keeps_what_ended_ranks_reported_and_says_why_the_rest_is_missing() -> None:
    reports: queue.Queue[Any] = queue.Queue()
    reports.put((0, 0, RankResult(rank=0, steps=3)))
    procs = [_Exited(0), _Exited(1), _Exited(-9)]
    results = launch._collect(reports, procs, expected=6, deadline=time.monotonic() + 30)
    assert results == {(0, 0): RankResult(rank=0, steps=3)}
    assert launch._lost(1, 1, procs[1]) == RankResult(
        rank=1, error_type="Lost", error="rank 1 exited with code 1 before reporting config 1")
    assert launch._lost(2, 0, procs[2]).error == "rank 2 timed out before reporting config 0"
    assert launch._lost(0, 0, _Exited(None)).error == "rank 0 timed out before reporting config 0"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> SpawnedRun:
    # Ranks are started with an extra sitecustomize on PYTHONPATH, as `replay record` starts them.
    site, markers = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("markers")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        mp.setenv("MTP_TEST_MARKERS", str(markers))
        results = run_many(list(TWO_RANK.values()), ranks=2, steps=STEPS, digests=True, timeout_s=240)
    return SpawnedRun(dict(zip(TWO_RANK, results)), [p.name for p in markers.iterdir()])


@pytest.fixture(scope="module")
def two_ranks(spawned: SpawnedRun) -> dict[str, list[RankResult]]:
    return spawned.results


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[RankResult]]:
    results = run_many(list(FOUR_RANK.values()), ranks=4, steps=6, digests=True, timeout_s=240)
    return dict(zip(FOUR_RANK, results))


def test_ranks_run_an_injected_sitecustomize(spawned: SpawnedRun) -> None:
    assert len(spawned.started) >= 2  # both ranks (and maybe the resource tracker)


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_clean_ranks_stay_identical(two_ranks: dict[str, list[RankResult]]) -> None:
    r0, r1 = two_ranks["clean"]
    assert r0.error is None and r1.error is None and r0.steps == r1.steps == STEPS
    assert r0.tokens == r1.tokens and r0.logits_digests == r1.logits_digests
    assert r0.graph_steps == STEPS


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_forced_tactic_drifts_in_replicated_layout(two_ranks: dict[str, list[RankResult]]) -> None:
    for r in two_ranks["drift"]:
        assert r.error_type == "RankDriftError", r.error
        assert r.drift_ranks == [1] and r.drift_step is not None and r.drift_step < STEPS
        assert f"decode step {r.drift_step}" in (r.error or "") and "rank 1" in (r.error or "")
    assert two_ranks["drift"][1].tuner_choices == {"moe_combine": "bf16"}


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_keeps_lockstep_despite_forced_tactic(two_ranks: dict[str, list[RankResult]]) -> None:
    r0, r1 = two_ranks["drift-tp"]
    assert r0.error is None and r1.error is None and r0.steps == STEPS
    assert r0.tokens == r1.tokens and r0.logits_digests == r1.logits_digests


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_broadcast_tokens_completes_and_hides_drift(two_ranks: dict[str, list[RankResult]]) -> None:
    r0, r1 = two_ranks["drift-broadcast"]
    assert r0.error is None and r1.error is None and r0.steps == STEPS
    assert r0.tokens == r1.tokens
    assert r0.overridden_steps == 0 and r1.overridden_steps > 0


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_broadcast_tuner_agrees_across_ranks(two_ranks: dict[str, list[RankResult]]) -> None:
    r0, r1 = two_ranks["tuner-broadcast"]
    assert r0.error is None and r0.tuner_choices == r1.tuner_choices and "moe_combine.m16" in r0.tuner_choices


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_tp_matches_replicated_first_steps(four_ranks: dict[str, list[RankResult]]) -> None:
    _, replicated = run_steps(3)
    for r in four_ranks["tp"]:
        assert r.error is None
        assert r.prefill_tokens == replicated.prefill_tokens
        assert r.tokens[:3] == replicated.tokens
    # The all-reduce gives every rank the same bits.
    assert len({r.logits_digests[0] for r in four_ranks["tp"]}) == 1


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_one_shot_allreduce_gives_ranks_different_bits(four_ranks: dict[str, list[RankResult]]) -> None:
    results = four_ranks["tp-one-shot"]
    assert all(r.error in (None,) or r.error_type == "RankDriftError" for r in results)
    assert len({r.logits_digests[0] for r in results}) > 1


@pytest.mark.e2e  # multi-process, module-scoped fixture: `make test-e2e`
def test_drift_names_the_odd_rank_out(four_ranks: dict[str, list[RankResult]]) -> None:
    for r in four_ranks["drift-rank2"]:
        assert r.error_type == "RankDriftError", r.error
        assert r.drift_ranks == [2] and r.steps == r.drift_step


# -- command line ---------------------------------------------------------------------------------


def test_cli_reports_drift_with_exit_code_3() -> None:
    runner = CliRunner()
    args = [
        "--ranks",
        "2",
        "--steps",
        "12",
        "--seed",
        str(FAST_DRIFT["seed"]),
        "--batch",
        str(FAST_DRIFT["batch"]),
    ]
    result = runner.invoke(main, [*args, "--force-tactic", DRIFT])
    assert result.exit_code == EXIT_DRIFT, result.output
    err_lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("error: rank drift at decode step")
    assert "Traceback" not in result.output


def test_cli_rejects_bad_force_tactic() -> None:
    result = CliRunner().invoke(main, ["--force-tactic", "oops"])
    assert result.exit_code == 2 and "RANK:OP:TACTIC" in result.output
