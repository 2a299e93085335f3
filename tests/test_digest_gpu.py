"""rd64 on a CUDA GPU: equal to the CPU reference for every dtype, size and layout, independent
of the launch shape, and capturable in a CUDA graph. Run by `make test-gpu`."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np
import pytest
import torch

from replay.digest import (
    DigestBuffer,
    _sum_words_fast,
    digest,
    digest_into,
    digest_many,
    digest_numpy,
    from_int64,
    warmup,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

GiB = 1 << 30


def _cpu_digest(t: torch.Tensor) -> int:
    """The CPU path on a host copy: the value the GPU must reproduce."""
    host = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return digest_numpy(host.reshape(-1).view(torch.uint8).numpy())


def _random(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``[n]`` of ``dtype`` with random bits (NaNs and all), made on the GPU."""
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda", generator=g)
    return raw.view(dtype)


_DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]
_SIZES = [0, 1, 2, 3, 4, 5, 17, 1023, 4096, 4096 * 3 + 1, (1 << 20) + 3, 12_345_679]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("n", _SIZES)
def test_gpu_equals_cpu(dtype: torch.dtype, n: int) -> None:
    t = _random(n, dtype, seed=n)
    assert digest(t) == _cpu_digest(t)


def test_bool_tensor() -> None:
    t = _random(10_001, torch.uint8) > 127
    assert digest(t) == _cpu_digest(t)


@pytest.mark.parametrize("offset", range(8))
@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.bfloat16, torch.int32, torch.float64], ids=str
)
def test_storage_offsets(dtype: torch.dtype, offset: int) -> None:
    # Offsets that break 4-byte alignment take the copy path; 4-byte but not 16-byte aligned
    # ones take the kernel variant without 128-bit loads.
    base = _random(100_003, dtype, seed=offset)
    t = base[offset:]
    assert digest(t) == _cpu_digest(t)


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),
        lambda b: b[::3, 1::2],
        lambda b: b[:, 7],
        lambda b: b[5:, :-3].t(),
        lambda b: b[:1, :1].expand(64, 33),
        lambda b: torch.complex(b[:8].float(), b[8:16].float()).conj(),
    ],
    ids=["transpose", "steps", "column", "sliced transpose", "expand", "conj"],
)
def test_non_contiguous(make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    t = make(_random(257 * 129, torch.bfloat16).reshape(257, 129))
    assert digest(t) == _cpu_digest(t) == digest(t.resolve_conj().contiguous())


def test_more_than_one_gib() -> None:
    t = _random(GiB + GiB // 8 + 3, torch.uint8, seed=42)
    assert digest(t) == _cpu_digest(t)


def test_word_indices_past_2_32() -> None:
    # The hi32(i) key term with a small tensor: the kernel's words start at index ~2**32.
    from replay import _digest_triton as k

    words = _random(3 * 4096 * 8 + 77, torch.int32, seed=3)
    host = words.cpu().numpy().view(np.uint32)
    block = k.DEFAULT_CONFIG.block
    for first in [2**32 - 8 * block, 2**32, 3 * 2**32 - block, 2**40]:
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        k.accumulate_word_sum(words, out, 0, first)
        assert from_int64(int(out.item())) == _sum_words_fast(host, first), first


@pytest.mark.slow
def test_tensor_over_16_gib() -> None:
    # A real tensor past 2**32 words (16 GiB); the reference is computed chunk by chunk.
    n = 16 * GiB + GiB // 4 + 2
    free, _ = torch.cuda.mem_get_info()
    if free < n + 2 * GiB:
        pytest.skip("needs about 19 GiB of free GPU memory")
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    chunk = GiB
    for start in range(0, n, chunk):
        t[start : start + chunk].copy_(
            _random(min(chunk, n - start), torch.uint8, seed=start // chunk)
        )
    got = digest(t)
    total = 0
    n_full = n // 4
    for start in range(0, n_full, chunk // 4):
        count = min(chunk // 4, n_full - start)
        words = t[4 * start : 4 * (start + count)].cpu().numpy().view(np.uint32)
        total += _sum_words_fast(words, start)
    tail = np.zeros(4, dtype=np.uint8)
    tail[: n % 4] = t[4 * n_full :].cpu().numpy()
    total += _sum_words_fast(tail.view(np.uint32), n_full)
    assert got == (total + n * 0x9E3779B97F4A7C15) % 2**64


def test_launch_shape_does_not_change_the_value() -> None:
    from replay import _digest_triton as k

    t = _random(5 * 4096 * 4 * 33 + 7, torch.uint8, seed=9)
    flat = t  # already 1-D, contiguous, aligned
    expected = _cpu_digest(t)
    configs = [
        k.KernelConfig(block=b, num_warps=w, programs_per_sm=p, shift_mode=m)
        for b, w, p, m in [
            (1024, 4, 8, 0),
            (2048, 8, 2, 1),
            (4096, 8, 4, 2),
            (8192, 16, 1, 1),
            (256, 2, 32, 0),
        ]
    ]
    for config in configs:
        for grid in (None, 1, 3, 1000):
            out = torch.zeros(1, dtype=torch.int64, device="cuda")
            k.accumulate_digest(flat, out, 0, config=config, grid=grid)
            assert from_int64(int(out.item())) == expected, (config, grid)


def test_repeated_runs_are_equal() -> None:
    t = _random(10_000_019, torch.float32, seed=5)
    values = {digest(t) for _ in range(20)}
    assert values == {_cpu_digest(t)}


def test_digest_into_leaves_other_slots_alone_and_overwrites_its_own() -> None:
    t = _random(1000, torch.int64)
    out = torch.full((3,), 12345, dtype=torch.int64, device="cuda")
    digest_into(t, out, 1)
    digest_into(t, out, 1)  # zeroes before adding: twice is the same as once
    values = out.tolist()
    assert values[0] == values[2] == 12345
    assert from_int64(values[1]) == _cpu_digest(t)


def test_digest_into_in_a_cuda_graph_follows_the_input() -> None:
    warmup()
    x = _random(3 * 4096 * 4 + 5, torch.uint8, seed=1)  # static input: blocks, partial, tail
    y = _random(999, torch.bfloat16, seed=2).reshape(27, 37)
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    # Warm up on a side stream before capturing, as torch.cuda.graph recommends.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        digest_into(x, out, 0)
        digest_into(y.t(), out, 1)
        digest_into(x[1:], out, 2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        digest_into(x, out, 0)
        digest_into(y.t(), out, 1)  # a non-contiguous input: the copy is captured too
        digest_into(x[1:], out, 2)  # misaligned: the aligned copy is captured too
    for seed in range(3, 8):
        x.copy_(_random(x.numel(), torch.uint8, seed=seed))
        y.copy_(_random(y.numel(), torch.bfloat16, seed=seed).reshape(y.shape))
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert [from_int64(v) for v in out.tolist()] == [
            _cpu_digest(x),
            _cpu_digest(y.t()),
            _cpu_digest(x[1:]),
        ]


def test_digest_buffer_in_a_cuda_graph() -> None:
    warmup()
    a = _random(4096 * 16, torch.float32, seed=1)
    b = _random(77, torch.int8, seed=2)
    buf = DigestBuffer(3, device="cuda")
    buf.clear()
    buf.put(0, a)
    buf.put(2, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.clear()
        buf.put(0, a)
        buf.put(2, b)
    for step in range(4):
        a.copy_(_random(a.numel(), torch.float32, seed=10 + step))
        graph.replay()
        assert buf.read() == [_cpu_digest(a), 0, _cpu_digest(b)]


def test_capture_refuses_a_cpu_tensor() -> None:
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            digest_into(torch.ones(4), out, 0)


def test_digest_many_mixes_devices() -> None:
    tensors = [_random(n, torch.float16, seed=n) for n in (0, 1, 5, 100_000)] + [torch.arange(9)]
    assert digest_many(tensors) == [_cpu_digest(t) for t in tensors]


def test_out_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device"):
        digest_into(_random(10, torch.uint8), torch.zeros(1, dtype=torch.int64), 0)


@pytest.mark.multigpu
def test_second_gpu_runs_on_its_own_device() -> None:
    with torch.cuda.device(0):
        t = _random(1_000_003, torch.uint8).to("cuda:1")
        out = torch.zeros(2, dtype=torch.int64, device="cuda:1")
        digest_into(t, out, 1)
        assert from_int64(int(out[1].item())) == _cpu_digest(t)
        assert digest(t) == _cpu_digest(t)
