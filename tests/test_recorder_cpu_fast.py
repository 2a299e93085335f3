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


# -- the ring's CPU copies and the meta's templates -----------------------------------------------

import json  # noqa: E402

import torch  # noqa: E402

from replay.format.schema import TensorKind  # noqa: E402
from replay.record.ring import ShmRing  # noqa: E402
from replay.record.job_meta import _META_JSON, RING_ATS, MetaText, job_meta  # noqa: E402
from replay.record.staging import Staging  # noqa: E402
from replay.record.writer import Job  # noqa: E402


def _cpu_cases() -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    return [
        ("int64", torch.arange(7)),
        ("bf16", torch.linspace(-3, 3, 9).to(torch.bfloat16)),
        ("bool", torch.tensor([True, False, True])),
        ("transposed", base.t()),
        ("strided row", base[:, ::2]),
        ("offset view", base[1:3]),
        ("lazy conjugate", z.conj()),
        ("lazy negation", torch._neg_view(z)),
        ("empty", torch.zeros(0, 3)),
        ("scalar", torch.tensor(2.5)),
        ("parameter", torch.nn.Parameter(torch.ones(3))),
        ("requires grad", torch.ones(2, 2, requires_grad=True) * 3),
    ]


def test_cpu_tensors_land_in_the_ring_as_their_values(tmp_path) -> None:  # noqa: ANN001
    """Each kind of CPU tensor (plain ones by one C copy, the rest through numpy or torch): the
    ring holds its values in row-major order, and changing the tensor afterwards changes nothing."""
    ring = ShmRing(str(tmp_path), 1 << 20, rank=0)
    try:
        staging = Staging(ring)
        cases = _cpu_cases()
        job = staging.open_job()
        entries = staging.entries(job, None, [(n, TensorKind.INPUT, t, True) for n, t in cases], step=True)
        for (name, t), e in zip(cases, entries):
            want = t.detach().resolve_conj().resolve_neg().contiguous()
            assert e.ring_at >= 0, name
            got = np.asarray(ring.data[e.ring_at : e.ring_at + want.nbytes]).tobytes()
            assert got == want.reshape(-1).view(torch.uint8).numpy().tobytes(), name
            assert e.shape == tuple(t.shape), name
        cases[0][1].fill_(-1)
        assert np.asarray(ring.data[entries[0].ring_at : entries[0].ring_at + 56]).view(np.int64).tolist() == list(range(7))
    finally:
        ring.close(unlink=True)


def _meta(ats: list[int], name: str = "input_ids") -> dict:
    rows = [[name, 0, "int64", [4], True, 0, 32, None, -1], ["logits", 1, "float32", [4, 512], False, 0, 8192, None, 2]]
    return {"b": {"step": 3, "t0": 1.25, "status": "ok"}, "g": {"inputs": rows[:1], "outputs": rows[1:]}, "f": {}, RING_ATS: ats}


@pytest.mark.parametrize("name", ["input_ids", "50% of %d", "7213901478231045311", 'quote"d'])
def test_meta_text_is_the_meta_whatever_the_offsets(name: str) -> None:
    """Once a step's rows repeat, their text comes from a template: it must read back as the rows
    with each one's own offset, for any name (a ``%`` in it, the template's stand-in digits)."""
    text = MetaText()
    for ats in ([512, 1024], [-1, 64], [1 << 40, 0], [7, 9]):
        meta = _meta(ats, name)
        want = {k: v for k, v in meta.items() if k != RING_ATS}
        want["g"] = {"inputs": [[name, 0, "int64", [4], True, ats[0], 32, None, -1]],
                     "outputs": [["logits", 1, "float32", [4, 512], False, ats[1], 8192, None, 2]]}
        assert json.loads(text.encode(meta)) == want


def test_meta_rows_that_change_are_not_templated() -> None:
    text = MetaText()
    for i in range(40):
        meta = _meta([64 * i, 128 * i], name=f"t{i}")
        assert json.loads(text.encode(meta))["g"]["inputs"][0][0] == f"t{i}"
    assert all(t is None or "%d" not in t for _, t in text._templates)  # each set of rows seen once


def test_job_meta_offsets_come_back_in_row_order(tmp_path) -> None:  # noqa: ANN001
    ring = ShmRing(str(tmp_path), 1 << 20, rank=0)
    try:
        staging = Staging(ring)
        rjob = staging.open_job()
        a = staging.entries(rjob, None, [("a", TensorKind.INPUT, torch.arange(3), True), ("b", TensorKind.INPUT, torch.ones(5), True)])
        c = staging.entries(rjob, None, [("c", TensorKind.OUTPUT, torch.zeros(2, 2), False)])
        meta = job_meta(Job(kind=0, body={"step": 0}, groups={"inputs": a, "outputs": c}), rjob)
        plain = json.loads(_META_JSON.encode({k: v for k, v in meta.items() if k != RING_ATS}))
        got = json.loads(MetaText().encode(meta))
        assert [r[5] for r in got["g"]["inputs"] + got["g"]["outputs"]] == [e.ring_at for e in a + c]
        assert {k: v for k, v in got.items() if k != "g"} == {k: v for k, v in plain.items() if k != "g"}
    finally:
        ring.close(unlink=True)
