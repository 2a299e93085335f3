"""A host generator's state (numpy's, random's) kept in a keyframe and set back: the same draws."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from replay.core.host_generators import host_generator_state, set_host_generator_state
from replay.core.state import capture_generators, restore_generators


@pytest.mark.parametrize("make", [
    lambda: np.random.default_rng(7),
    lambda: np.random.Generator(np.random.MT19937(7)),
    lambda: np.random.Generator(np.random.Philox(7)),
    lambda: np.random.RandomState(7),
    lambda: random.Random(7),
])
def test_a_kept_state_gives_the_same_draws_again(make) -> None:  # noqa: ANN001
    g = make()
    g.random()
    kept = host_generator_state(g)
    first = [g.random() for _ in range(5)]
    set_host_generator_state(g, kept)
    assert [g.random() for _ in range(5)] == first


def test_a_state_of_another_kind_or_a_hostile_array_is_refused() -> None:
    kept = host_generator_state(np.random.default_rng(1))
    with pytest.raises(ValueError):
        set_host_generator_state(random.Random(1), kept)
    hostile = {"__kind__": "numpy.Generator", "state": {"__array__": "object", "values": [1]}}
    with pytest.raises(ValueError):
        set_host_generator_state(np.random.default_rng(1), torch.frombuffer(bytearray(json.dumps(hostile).encode()), dtype=torch.uint8))


class _Sampler:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(3)
        self.g = torch.Generator().manual_seed(3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Engine:
    def __init__(self) -> None:
        self.sampler = _Sampler()
        self.py = random.Random(5)
        self.step_fn = lambda x: x  # code, not state: never looked into


def test_a_target_s_own_and_its_callable_sampler_s_generators_are_captured_and_restored() -> None:
    eng = _Engine()
    kept = capture_generators(eng)
    assert sorted(kept) == ["__gen__.py", "__gen__.sampler.g", "__gen__.sampler.rng"]
    draws = (eng.sampler.rng.random(), torch.rand(1, generator=eng.sampler.g).item(), eng.py.random())
    failed = restore_generators(eng, {k[len("__gen__."):]: v for k, v in kept.items()})
    assert failed == []
    assert (eng.sampler.rng.random(), torch.rand(1, generator=eng.sampler.g).item(), eng.py.random()) == draws
