"""`bisect layers` when a module gets a different number of rows on the two sides.

Newcomer trial 21: a top-2 MoE whose rank 1 drops tokens (expert capacity 1 instead of 2) at one
step. Its expert 0 then gets 2 token rows on rank 0 and 1 on rank 1. The comparison trimmed rank
0's extra row as "padding", called the expert's inputs bitwise equal and blamed its first
``nn.Linear`` for the rounding of a GEMM over 2 rows instead of 1 ("the difference is made inside
it"). The difference is made by the MoE's routing (its inputs are equal); a different number of
rows is a difference. Padding stays where it is one: a graph's batch padded to its bucket,
against the eager batch.

The two sides are run in-process (taps on a tiny model, as ``bisect layers`` puts them) and
compared as ``bisect layers`` compares two re-runs of a step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from replay.bisect.layers import LayersBisection, Side, SideRun, _bisection
from replay.bisect.taps import Taps
from replay.cli.bisect import render_layers

D, E, TOPK = 32, 4, 2


class _Stub:
    """What Taps.install needs of a Target."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def module(self) -> torch.nn.Module:
        return self.model


class _MoE(torch.nn.Module):
    """Top-2 routing with capacity dropping: an expert takes at most ``capacity`` tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, E, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D)) for _ in range(E))
        self.capacity = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x).softmax(-1).topk(TOPK, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            tok, slot = tok[: self.capacity], slot[: self.capacity]
            if tok.numel():
                out[tok] += w[tok, slot, None] * self.experts[e](x[tok])
        return out


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(D)
        self.mlp = _MoE()
        self.head = torch.nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(self.norm(x)))


def _side(side: Side, model: torch.nn.Module, x: torch.Tensor, ran_as: str) -> SideRun:
    taps = Taps()
    taps.install(_Stub(model))  # type: ignore[arg-type]
    taps.arm()
    with torch.no_grad():
        out = model(x)
    cap = taps.disarm()
    taps.close()
    return SideRun(side=side, capture=cap, outputs={"logits": out}, reproduces=True, departed=None, keyframe=0,
                   ran_as=ran_as, params={}, seconds=0.0)


def _bisect(ra: SideRun, rb: SideRun) -> LayersBisection:
    return _bisection(SimpleNamespace(name="run-000"), 7, ra, rb, context=3, recording="")  # type: ignore[arg-type]


def _tokens(n: int = 4) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1))


def test_an_expert_given_fewer_rows_on_one_rank_is_not_blamed() -> None:
    x = _tokens()
    a, b = _Block().eval(), _Block().eval()
    b.mlp.capacity = 1  # rank 1 drops tokens: 8 top-2 picks over 4 experts, one expert has 2 or more
    r = _bisect(_side(Side("rank 0", 0, "eager"), a, x, "eager"), _side(Side("rank 1", 1, "eager"), b, x, "eager"))
    text = render_layers(r)
    rows = {m.name: m for m in r.modules}
    assert r.first is not None and r.first.module.startswith("mlp.experts.")
    # The first expert whose rows were dropped receives 2 rows on rank 0 and 1 on rank 1: its
    # inputs differ (they were "bitwise equal": the extra row was trimmed as padding).
    assert r.first.inputs_equal is False and r.first.input_rows == "2 vs 1 rows" and r.first.rows == "2 vs 1 rows"
    assert "the rest is padding" not in r.first.note and "2 vs 1 rows" in r.first.figures()
    # The MoE gets equal inputs and makes the difference: its routing sends the expert fewer rows.
    assert rows["mlp"].inputs_equal and rows["mlp"].verdict == "different"
    assert r.maker is rows["mlp"]
    assert "the difference is made in mlp" in r.verdict() and f"{r.first.name} (different, 2 vs 1 rows)" in r.verdict()
    assert "receives bitwise equal inputs" not in r.origin and "the difference is made inside it" not in r.origin
    assert "2 vs 1 rows" in r.origin and "the difference is made in mlp" in r.origin
    # The text says it too, not only the JSON: in the verdict, the table and a note.
    assert "the rest is padding" not in text
    assert "different number of rows" in text and "not trimmed as padding" in text
    assert text.count("2 vs 1 rows") >= 3


def test_the_same_capacity_on_both_ranks_is_equal() -> None:
    x = _tokens()
    r = _bisect(_side(Side("rank 0", 0, "eager"), _Block().eval(), x, "eager"),
                _side(Side("rank 1", 1, "eager"), _Block().eval(), x, "eager"))
    assert r.first is None and not any(m.rows or m.input_rows for m in r.modules)


@pytest.mark.parametrize("stale", [False, True], ids=["zero-padding", "stale-padding"])
def test_a_graph_s_padded_batch_is_compared_on_the_real_rows(stale: bool) -> None:
    """A graph runs 3 requests in a bucket of 4 rows: the fourth row is padding (zeros, or a
    previous batch's data when the runner does not reset it), compared on the real rows only."""
    x = _tokens(3)
    pad = _tokens(1) * 3 if stale else torch.zeros(1, D)
    eager = _side(Side("eager", 0, "eager"), _Block().eval(), x, "eager eager3")
    graph = _side(Side("cudagraph", 0, "cudagraph"), _Block().eval(), torch.cat([x, pad]), "graph bs4")
    r = _bisect(eager, graph)
    # A GEMM over 4 rows may round otherwise than over 3 (and pass that on to the modules after
    # it): within tolerance at most, never different, and never a difference in rows.
    assert not any(m.verdict == "different" for m in r.modules)
    assert not any(m.rows or m.input_rows for m in r.modules) and r.modules[0].inputs_equal
    assert any("first 3 rows compared (3 vs 4: the rest is padding)" in m.note for m in r.modules)
    assert all(c.verdict.value != "different" for c in r.outputs)
    # The trimming is said in the text, not only in each module's note of the JSON.
    assert "compared on their first rows only" in render_layers(r)


def test_more_rows_on_the_side_that_ran_no_graph_are_no_padding() -> None:
    """Padding is the graph side's: an eager side with the more rows has rows the graph lacks."""
    x = _tokens(4)
    r = _bisect(_side(Side("eager", 0, "eager"), _Block().eval(), x, "eager eager4"),
                _side(Side("cudagraph", 0, "cudagraph"), _Block().eval(), x[:3], "graph bs3"))
    assert r.first is not None and r.first.rows == "4 vs 3 rows" and r.first.inputs_equal is False
