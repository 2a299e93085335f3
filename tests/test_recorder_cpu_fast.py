"""The recorder's CPU fast paths give the same values as the plain ones: batched digests."""

from __future__ import annotations

import numpy as np
import pytest

from replay.digest import _digest_numpy_reference, digest_numpy_many


# Sizes around the edges of the batched path: empty, partial words, one chunk (2**16 words) and
# just over it (digested on its own), and enough small ones to fill more than one batch.
_SIZES = [0, 1, 3, 4, 5, 63, 64, 4096, 65535 * 4, 65536 * 4, 65536 * 4 + 1, 65536 * 4 + 4, 70000 * 4 + 3]


@pytest.mark.parametrize("seed", range(8))
def test_batched_digests_equal_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [int(rng.choice(_SIZES)) if rng.random() < 0.5 else int(rng.integers(0, 20000)) for _ in range(int(rng.integers(1, 40)))]
    bufs = [rng.integers(0, 256, n).astype(np.uint8) for n in sizes]
    assert digest_numpy_many(bufs) == [_digest_numpy_reference(b) for b in bufs]


def test_batched_digests_take_any_dtype_and_layout() -> None:
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal((8, 4, 64)).astype(np.float32), np.arange(12, dtype=np.int64).reshape(3, 4).T,
            np.zeros(0, np.int64), np.array([True, False, True])]
    assert digest_numpy_many(bufs) == [_digest_numpy_reference(b) for b in bufs]
    assert digest_numpy_many([]) == []
