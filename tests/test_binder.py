"""``calls.Binder``: a step's arguments bound once per call shape must be bound exactly as
``inspect.Signature.bind`` binds them (the recorder names inputs and arguments by them)."""

from __future__ import annotations

import inspect

import pytest

from replay.record.calls import Binder


def _step(self, ids, pos, cache=None, *, temperature=1.0):  # noqa: ANN001, ANN202 - a program's step
    return ids


def _plain(self, ids, pos, cache=None, temperature=1.0):  # noqa: ANN001, ANN202
    return ids


CALLS = [
    ((0, 1, 2), {}),
    ((0, 1, 2, 3), {}),
    ((0, 1), {"pos": 2}),
    ((0,), {"pos": 2, "ids": 1}),
    ((0, 1, 2), {"temperature": 0.5}),
    ((0, 1, 2), {"temperature": 0.5, "cache": 3}),
    ((0, 1), {}),  # missing pos: the program's own TypeError
    ((0, 1, 2), {"ids": 9}),  # ids twice
    ((0, 1, 2, 3, 4, 5), {}),  # too many
    ((0, 1, 2), {"top_k": 4}),  # unknown keyword
    ((), {"self": 0, "ids": 1, "pos": 2}),  # every argument by keyword, ``self`` too
]


def _bind(f, args, kwargs):  # noqa: ANN001, ANN202
    try:
        return list(f(*args, **kwargs).arguments.items())
    except TypeError as e:
        return ("TypeError", str(e))


@pytest.mark.parametrize("fn", [_step, _plain])
def test_bound_as_inspect_binds_every_call_shape_and_on_every_call(fn) -> None:  # noqa: ANN001
    sig = inspect.signature(fn)
    binder = Binder(sig)
    for _ in range(3):  # the first call of a shape plans it; the later ones use the plan
        for args, kwargs in CALLS:
            values = (tuple(f"v{a}" for a in args), {k: f"k{v}" for k, v in kwargs.items()})
            assert _bind(binder.bind, *values) == _bind(sig.bind, *values), values
    if fn is _plain:
        assert binder._plans, "plain signatures are planned"
    else:
        assert not binder._plans, "a keyword-only parameter: inspect binds every call"


def test_a_planned_shape_binds_new_values_not_the_first_ones() -> None:
    binder = Binder(inspect.signature(_plain))
    first = binder.bind("self", "a", pos="b").arguments
    again = binder.bind("self", "x", pos="y").arguments
    assert first == {"self": "self", "ids": "a", "pos": "b"}
    assert again == {"self": "self", "ids": "x", "pos": "y"} and list(again) == ["self", "ids", "pos"]


def _replay(self, bucket, flag=True, name="x", *rest):  # noqa: ANN001, ANN202 - a runner's replay
    return bucket


@pytest.mark.parametrize("fn", [_plain, _replay, _step])
def test_graph_keys_through_a_binder_are_the_signatures(fn) -> None:  # noqa: ANN001
    """A replay's graph key (looked up every step) is the one its capture was recorded under."""
    from replay.record.calls import call_key

    sig = inspect.signature(fn)
    binder = Binder(sig)
    calls = CALLS + [((0, 8), {}), ((0, 8, False, "y"), {}), ((0,), {"bucket": 16}), ((0, 4, True, "z", 1, 2), {})]
    for _ in range(2):  # the second time, calls of a known shape take the binder's plan
        for args, kwargs in calls:
            assert call_key(binder, args, kwargs) == call_key(sig, args, kwargs), (args, kwargs)
