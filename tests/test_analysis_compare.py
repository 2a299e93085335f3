"""`replay.analysis.compare`: verdicts about bits first, numbers second, and a line that says which."""

from __future__ import annotations

import math

import pytest
import torch

from replay.analysis.compare import Verdict, compare_digests, compare_tensors, top2_margin, ulp_distance


def test_equal_bits_are_bitwise_equal_with_the_figures_that_go_with_it() -> None:
    a = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    c = compare_tensors(a, a.clone(), name_a="eager", name_b="graph")
    assert c.verdict is Verdict.BITWISE_EQUAL and c.equal
    assert (c.max_abs, c.ulp, c.mismatched, c.numel, c.argmax_agree) == (0.0, 0, 0, 24, 1.0)
    assert str(c).startswith("eager vs graph: bitwise equal")


def test_equal_values_with_other_bits_are_not_called_equal() -> None:
    """0.0 and -0.0 compare equal as numbers; their bits differ, and bits are what replay promises."""
    c = compare_tensors(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert c.verdict is Verdict.WITHIN_TOLERANCE and not c.equal and c.max_abs == 0.0


@pytest.mark.parametrize("dtype, ulps", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float16, 1), (torch.float64, 2)],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_one_ulp_apart_is_within_tolerance_and_counted(dtype: torch.dtype, ulps: int) -> None:
    a = torch.tensor([1.0, 2.0, -3.0], dtype=dtype)
    b = a.clone()
    it = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)
    b.view(it)[2] += ulps  # -3.0 moved ulps steps away from zero
    c = compare_tensors(a, b)
    assert c.verdict is Verdict.WITHIN_TOLERANCE and c.ulp == ulps and c.mismatched == 1 and c.numel == 3
    assert ulp_distance(a, b) == ulps and "1/3 elements differ" in str(c)


def test_ulp_distance_crosses_zero() -> None:
    tiny = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # the smallest positive subnormal
    assert ulp_distance(tiny, -tiny) == 2 and ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])) == 0


def test_a_real_difference_is_different_and_says_how_much() -> None:
    a = torch.tensor([[1.0, 5.0, 2.0], [0.0, 1.0, 3.0]])
    b = a.clone()
    b[0, 0] = 9.0  # row 0's argmax moves
    c = compare_tensors(a, b)
    assert c.verdict is Verdict.DIFFERENT and c.max_abs == 8.0 and c.argmax_agree == 0.5
    assert c.margin == pytest.approx(2.0)  # of a: row 1, 3 - 1 = 2 (row 0: 5 - 2 = 3)
    assert "argmax agrees on 50.0% of rows" in str(c)


def test_shape_dtype_and_integer_differences() -> None:
    c = compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))
    assert c.verdict is Verdict.DIFFERENT and "shape/dtype" in c.note
    assert compare_tensors(torch.zeros(2), torch.zeros(2, dtype=torch.float64)).verdict is Verdict.DIFFERENT
    t = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 7, 3]))
    assert (t.verdict, t.mismatched, t.max_abs) == (Verdict.DIFFERENT, 1, 5.0)
    assert compare_tensors(torch.zeros(0), torch.zeros(0)).verdict is Verdict.BITWISE_EQUAL


def test_nan_with_the_same_bits_is_equal_and_inf_does_not_break_the_figures() -> None:
    a = torch.tensor([math.nan, 1.0])
    assert compare_tensors(a, a.clone()).equal
    c = compare_tensors(torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 1.0]))
    assert c.verdict is Verdict.DIFFERENT and c.max_abs == 0.0  # only finite differences are measured


def test_digests_can_only_say_equal_or_different() -> None:
    assert compare_digests(5, 5).verdict is Verdict.BITWISE_EQUAL
    c = compare_digests(0xAB, 0xCD, name_a="re-run", name_b="recorded")
    assert c.verdict is Verdict.DIFFERENT and c.max_abs is None and "recorded as digests only" in c.note
    assert c.to_json()["verdict"] == "different" and str(Verdict.DIFFERENT) == "different"


def test_top2_margin_only_for_logit_like_tensors() -> None:
    assert top2_margin(torch.tensor([[1.0, 3.0, 2.5]])) == pytest.approx(0.5)
    assert top2_margin(torch.tensor([1, 2])) is None and top2_margin(torch.tensor([1.0])) is None


def test_within_tolerance_says_the_tolerance_it_was_judged_by() -> None:
    """"within tolerance" alone (step's verdict table, a not-reproduced reason) did not say which
    tolerance; the verdict carries the dtype's rtol and atol, and keeps them through --json."""
    from replay.rerun.result import comparison_from_json

    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0))
    c = compare_tensors(a, b)
    assert c.verdict_text == "within tolerance (rtol 1e-05, atol 1e-08)" and c.verdict_text in str(c), str(c)
    assert comparison_from_json(c.to_json()).verdict_text == c.verdict_text
    assert compare_tensors(a, a.clone()).verdict_text == "bitwise equal"
    # A damaged result file's tolerance is left out, never formatted from what it holds.
    assert comparison_from_json({**c.to_json(), "atol": "1e-8"}).verdict_text == "within tolerance"
