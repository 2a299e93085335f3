"""rd64 on the CPU: known answers, the properties the definition promises, the fast path against
the reference, the tensor API, and the Triton kernel under Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replay.digest import (
    DigestBuffer,
    _digest_numpy_reference,
    _flat_bytes,
    _sum_words,
    _sum_words_fast,
    digest,
    digest_bytes,
    digest_into,
    digest_many,
    digest_numpy,
    format_digest,
    from_int64,
    to_int64,
)

REPO = Path(__file__).resolve().parents[1]
_FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pattern(n: int) -> np.ndarray:
    """``[n]`` uint32: a fixed, position-dependent pattern (Knuth's multiplicative hash of i)."""
    with np.errstate(over="ignore"):
        return np.arange(n, dtype=np.uint32) * np.uint32(2654435761)


# Computed once from the reference in replay/digest.py when the definition was fixed. A failure
# here means the definition changed, and every stored digest with it: do not update the values.
KNOWN_ANSWERS: list[tuple[str, object, str]] = [
    ("empty", b"", "0000000000000000"),
    ("one zero byte", b"\x00", "026d7c6c7f4a7c15"),
    ("abc", b"abc", "3fff5fb5c08ac728"),
    ("abcd", b"abcd", "3849fe4145d4dfc0"),
    ("bytes 0..255", bytes(range(256)), "9301d6dc31a0107a"),
    ("replay!", b"replay!", "a338ecee105e40dd"),
    ("arange f32 1000", lambda: torch.arange(1000, dtype=torch.float32), "e747c6bf6227f0ea"),
    (
        "arange i64 2x3",
        lambda: torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "48e9f31f5bfe3537",
    ),
    (
        "bf16 eighths",
        lambda: (torch.arange(-38, 39, dtype=torch.float32) / 8).to(torch.bfloat16),
        "827f8b3d00deb335",
    ),
    ("bool", lambda: torch.tensor([True, False, True]), "4cb408dd58583f7f"),
    ("pattern 300001 words", lambda: torch.from_numpy(_pattern(300_001)), "64071d7d582c75d4"),
    (
        "pattern 1200003 bytes",
        lambda: torch.from_numpy(_pattern(300_001).view(np.uint8)[:1_200_003].copy()),
        "b29ad81a9e10515c",
    ),
]


@pytest.mark.parametrize(
    "value, expected", [(v, e) for _, v, e in KNOWN_ANSWERS], ids=[n for n, _, _ in KNOWN_ANSWERS]
)
def test_known_answers(value: object, expected: str) -> None:
    if isinstance(value, bytes):
        assert format_digest(digest_bytes(value)) == expected
        assert (
            format_digest(_digest_numpy_reference(np.frombuffer(value, dtype=np.uint8))) == expected
        )
    else:
        assert callable(value)
        t = value()
        assert format_digest(digest(t)) == expected
        assert (
            format_digest(_digest_numpy_reference(t.reshape(-1).view(torch.uint8).numpy()))
            == expected
        )


@pytest.mark.parametrize(
    "words, first_index, expected",
    [
        (np.arange(8, dtype=np.uint32), 2**32 - 4, "76768c47cc02d013"),
        (
            np.arange(1, 6, dtype=np.uint32) * np.uint32(0x01010101),
            3 * 2**32 + 7,
            "be0bc344825b3f6a",
        ),
        (_pattern(300_001)[:100_000], 2**32 - 50_000, "0b778ffb522f5a43"),
    ],
    ids=["straddles 2**32", "past 3*2**32", "long run across 2**32"],
)
def test_known_answers_past_2_32_words(words: np.ndarray, first_index: int, expected: str) -> None:
    # Word indices past 2**32 (tensors over 16 GiB) bring in the hi32(i) key term.
    assert format_digest(_sum_words(words, first_index)) == expected
    assert format_digest(_sum_words_fast(words, first_index)) == expected


# --- The fast CPU path against the reference.


@_FAST
@given(data=st.binary(max_size=2000))
def test_fast_path_equals_reference(data: bytes) -> None:
    assert digest_bytes(data) == _digest_numpy_reference(np.frombuffer(data, dtype=np.uint8))


@pytest.mark.parametrize("n", [1, 65_535, 65_536, 65_537, 3 * 65_536 + 11])
@pytest.mark.parametrize(
    "first_index", [0, 12_345, 2**32 - 65_536, 2**32 - 70_001, 2**32 + 9, 7 * 2**32 - 3]
)
def test_fast_word_sums_at_chunk_and_2_32_boundaries(n: int, first_index: int) -> None:
    words = _pattern(n) ^ np.uint32(0xA5A5A5A5)
    assert _sum_words_fast(words, first_index) == _sum_words(words, first_index)


def test_fast_path_reads_unaligned_numpy_words() -> None:
    raw = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    for offset in range(1, 4):
        assert digest_numpy(raw[offset:]) == _digest_numpy_reference(raw[offset:].copy())


# --- The promises of the definition.


@_FAST
@given(data=st.binary(min_size=1, max_size=600), where=st.integers(min_value=0))
def test_any_bit_flip_changes_the_digest(data: bytes, where: int) -> None:
    bit = where % (8 * len(data))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert digest_bytes(bytes(flipped)) != digest_bytes(data)


_SWAP_DTYPES = [
    torch.uint8,
    torch.int16,
    torch.bfloat16,
    torch.int32,
    torch.float32,
    torch.int64,
    torch.float64,
]


@_FAST
@given(
    dtype=st.sampled_from(_SWAP_DTYPES),
    raw=st.binary(min_size=16, max_size=512),
    i=st.integers(min_value=0),
    j=st.integers(min_value=0),
)
def test_any_swap_of_two_different_elements_changes_the_digest(
    dtype: torch.dtype, raw: bytes, i: int, j: int
) -> None:
    size = torch.empty(0, dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(raw[: len(raw) // size * size]), dtype=dtype).clone()
    i, j = i % t.numel(), j % t.numel()
    bits = t.view(torch.uint8).reshape(t.numel(), size)  # [numel, element bytes]
    assume(not torch.equal(bits[i], bits[j]))  # swapping equal bits is no change at all
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    assert digest(swapped) != digest(t)


@_FAST
@given(raw=st.binary(max_size=400))
def test_equal_bits_give_equal_digests(raw: bytes) -> None:
    t = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    first = digest(t)
    assert digest(t) == first
    assert digest(t.clone()) == first
    assert digest_bytes(raw) == first


@_FAST
@given(words=st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=64))
def test_digest_sees_bytes_not_shape_or_dtype(words: list[int]) -> None:
    t = torch.tensor(np.array(words, dtype=np.uint32).view(np.int32))  # [n] int32
    expected = digest(t)
    assert digest(t.view(torch.uint8)) == expected
    assert digest(t.view(torch.int16).reshape(-1, 2)) == expected
    assert digest(t.view(torch.float32)) == expected
    assert digest(t.view(torch.bfloat16).reshape(1, -1, 1)) == expected
    if len(words) % 2 == 0:
        assert digest(t.view(torch.int64).reshape(-1, 1)) == expected
    assert digest(t[0]) == digest(t[:1])  # a 0-dim tensor is its one element's bytes


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int64, torch.bool], ids=str)
def test_empty_tensors_digest_to_zero(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert digest(torch.empty(shape, dtype=dtype)) == 0


@pytest.mark.parametrize("n", range(1, 13))
def test_odd_sizes_pad_the_last_word_and_count_the_length(n: int) -> None:
    data = bytes(range(1, n + 1))
    assert digest(torch.tensor(list(data), dtype=torch.uint8)) == digest_bytes(data)
    # The same words with an explicit zero byte appended differ only by the length.
    assert digest_bytes(data + b"\x00") != digest_bytes(data)


@_FAST
@given(raw=st.binary(max_size=300))
def test_digest_bytes_equals_digest_of_a_uint8_tensor(raw: bytes) -> None:
    t = torch.tensor(list(raw), dtype=torch.uint8)
    assert digest_bytes(raw) == digest(t)
    assert digest_bytes(bytearray(raw)) == digest_bytes(memoryview(raw)) == digest_bytes(raw)


def _views() -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(7 * 12, dtype=torch.float32).reshape(7, 12)
    return [
        ("transpose", base.t()),
        ("step slice", base[::2, 1::3]),
        ("column", base[:, 5]),
        ("expand", torch.arange(5, dtype=torch.int16).expand(3, 5)),
        ("odd byte offset", torch.arange(100, dtype=torch.uint8)[1:]),
        ("bf16 odd offset", torch.arange(50, dtype=torch.bfloat16)[3:40]),
        ("conj view", torch.complex(base[:2], base[2:4]).conj()),
        ("neg view", torch.complex(base[:2], base[2:4]).conj().imag),
    ]


@pytest.mark.parametrize("view", [v for _, v in _views()], ids=[n for n, _ in _views()])
def test_non_contiguous_views_equal_their_contiguous_copy(view: torch.Tensor) -> None:
    copy = view.resolve_conj().resolve_neg().contiguous()
    assert digest(view) == digest(copy)
    assert digest(view) == digest_numpy(copy.reshape(-1).view(torch.uint8).numpy())


def test_flat_bytes_are_word_aligned_even_from_a_misaligned_buffer() -> None:
    # What the GPU path reads: torch.frombuffer can start a storage mid-word, so alignment in
    # memory and alignment of the storage offset differ; both must hold for the int32 view.
    raw = bytearray(bytes(range(97)))
    base = torch.frombuffer(memoryview(raw)[1:], dtype=torch.uint8)  # [96]
    for start in range(5):
        flat = _flat_bytes(base[start:])
        assert flat.data_ptr() % 4 == 0 and flat.storage_offset() % 4 == 0
        assert flat[: flat.numel() // 4 * 4].view(torch.int32).numel() == flat.numel() // 4
        assert bytes(flat.numpy()) == bytes(raw[1 + start :])


def test_other_dtypes_digest_their_bits() -> None:
    for dtype in [
        torch.float16,
        torch.complex64,
        torch.int8,
        getattr(torch, "float8_e4m3fn", torch.uint8),
    ]:
        t = torch.arange(24, dtype=torch.float32).to(dtype)
        assert digest(t) == digest_bytes(t.view(torch.uint8).numpy().tobytes()), dtype


def test_sparse_tensors_are_refused_with_a_fix() -> None:
    with pytest.raises(TypeError, match="to_dense"):
        digest(torch.eye(3).to_sparse())


# --- The API around the value.


def test_int64_conversion_round_trips() -> None:
    for d in [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]:
        v = to_int64(d)
        assert -(2**63) <= v < 2**63
        assert from_int64(v) == d
        assert torch.tensor([v], dtype=torch.int64).tolist() == [v]
    assert format_digest(2**64 - 1) == "f" * 16 and format_digest(5) == "0000000000000005"


def test_digest_into_writes_int64_bits_on_cpu() -> None:
    out = torch.full((3,), 7, dtype=torch.int64)
    t = torch.arange(1000, dtype=torch.float32)
    digest_into(t, out, 1)
    assert from_int64(int(out[1])) == digest(t) == 0xE747C6BF6227F0EA
    assert out[0] == 7 and out[2] == 7  # neighbours untouched
    digest_into(t[:0], out)  # index defaults to 0
    assert out[0] == 0


@pytest.mark.parametrize(
    "out, index, error",
    [
        (torch.zeros(2, dtype=torch.int32), 0, TypeError),
        (torch.zeros(2, 2, dtype=torch.int64), 0, TypeError),
        (torch.zeros(2, dtype=torch.int64), 2, IndexError),
        (torch.zeros(2, dtype=torch.int64), -1, IndexError),
    ],
    ids=["int32", "2-D", "past the end", "negative"],
)
def test_digest_into_refuses_bad_slots(
    out: torch.Tensor, index: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        digest_into(torch.ones(3), out, index)


def test_digest_many_equals_one_by_one() -> None:
    tensors = [torch.arange(n, dtype=torch.int32) for n in (0, 1, 7, 1000)] + [torch.ones(3, 3).t()]
    assert digest_many(tensors) == [digest(t) for t in tensors]
    assert digest_many(iter(tensors[:2])) == [digest(tensors[0]), digest(tensors[1])]
    assert digest_many([]) == []


def test_digest_buffer_on_cpu() -> None:
    buf = DigestBuffer(3, device="cpu")
    assert len(buf) == 3 and buf.values.dtype == torch.int64
    a, b = torch.arange(10), torch.arange(11, dtype=torch.uint8)
    buf.clear()
    buf.put(0, a)
    buf.put(2, b)
    assert buf.read() == [digest(a), 0, digest(b)]
    with pytest.raises(ValueError):
        DigestBuffer(0, device="cpu")


# --- The Triton kernel, run by Triton's interpreter on the CPU.

# TRITON_INTERPRET must be set before triton is imported, so this runs in a fresh interpreter.
_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.runtime.interpreter as interp

    # numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does for
    # loop bounds (triton-lang/triton#9171, fixed by #9172 after 3.6); same fix, applied here.
    _patch = interp._patch_lang_tensor
    def _patched(tensor, scope):
        _patch(tensor, scope)
        index = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])  # noqa: E731
        scope.set_attr(tensor, "__index__", index)
    interp._patch_lang_tensor = _patched

    from replay import _digest_triton as k
    from replay.digest import _flat_bytes, _sum_words, digest_bytes, from_int64

    rng = np.random.default_rng(7)
    checked = 0

    def kernel_digest(flat, config, grid):
        out = torch.full((3,), 5, dtype=torch.int64)
        out[1] = 0
        k.accumulate_digest(flat, out, 1, config=config, grid=grid)
        assert out[0] == 5 and out[2] == 5, "neighbouring slots were written"
        return from_int64(int(out[1]))

    small = k.KernelConfig(block=32, num_warps=1)
    # sizes: no full word, one word, partial block only, exact blocks, blocks + partial + tail
    for n in [3, 4, 5, 128, 32 * 4 * 3 + 4 * 7 + 3, 1001]:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        for grid in (None, 1, 7):  # 7 > blocks for most sizes: idle programs
            got = kernel_digest(torch.from_numpy(data.copy()), small, grid)
            assert got == digest_bytes(data.tobytes()), (n, grid)
            checked += 1
    for mode in (0, 2):  # mode 1 ran above: the three ways to shift give the same bits
        data = rng.integers(0, 256, 777, dtype=np.uint8)
        config = k.KernelConfig(block=32, num_warps=1, shift_mode=mode)
        got = kernel_digest(torch.from_numpy(data), config, 3)
        assert got == digest_bytes(data.tobytes()), mode
        checked += 1
    # the default launch shape, on a tensor built through the public byte view (odd offset -> copy)
    t = torch.from_numpy(rng.integers(0, 256, 2 * 4096 * 4 + 4 * 5 + 3, dtype=np.uint8))[1:]
    got = kernel_digest(_flat_bytes(t), k.DEFAULT_CONFIG, None)
    assert got == digest_bytes(t.numpy().tobytes())
    checked += 1
    # word indices past 2**32: the hi32(i) key term, and a block boundary at 2**32
    words = rng.integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)
    for first in [0, 2**32 - 96, 2**32, 5 * 2**32 - 64]:
        out = torch.zeros(1, dtype=torch.int64)
        w32 = torch.from_numpy(words.view(np.int32).copy())
        k.accumulate_word_sum(w32, out, 0, first, config=small, grid=3)
        assert from_int64(int(out[0])) == _sum_words(words, first), first
        checked += 1
    print("checked", checked)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_matches_reference_under_the_interpreter() -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checked 25" in proc.stdout, proc.stdout


# --- What the compiled kernel looks like, checked without a GPU (Triton compiles for a target
# it does not have): the interpreter does not catch compile errors, lost vectorisation, or
# arguments that would compile new variants during a CUDA graph capture.

_INT_ARGS = ("slot", "n_words", "n_blocks", "n_iter", "n_tail", "first_index", "extra")


def _triton_internals() -> tuple[Any, Any, Any, Any]:
    """``(triton, GPUTarget, ASTSource, CUDABackend)``, or a skip."""
    pytest.importorskip("triton")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
    except ImportError as e:  # internals move between Triton releases; these checks are for 3.6
        pytest.skip(f"this Triton lacks {e.name}")
    return triton, GPUTarget, ASTSource, CUDABackend


def test_kernel_variants_depend_only_on_alignment_and_tail() -> None:
    _, GPUTarget, _, CUDABackend = _triton_internals()
    from triton.runtime.jit import create_function_from_signature

    from replay import _digest_triton as k

    fn = k._rd64_kernel
    binder = create_function_from_signature(
        fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )
    words, tail, out = (
        torch.zeros(64, dtype=torch.int32),
        torch.zeros(4, dtype=torch.uint8),
        torch.zeros(4, dtype=torch.int64),
    )
    int_values = [
        (0, 1, 1, 1, 1, 0, 1),
        (3, 2**31, 2**33, 16, 2, 2**40, -(2**63)),
        (1, 16, 32, 48, 3, 64, 2**62),
    ]
    specs = set()
    for ints in int_values:
        for t, o in [(tail, out), (tail[1:], out[1:])]:
            _, spec, _ = binder(words, t, o, *ints, BLOCK=4096, HAS_TAIL=True, SHIFT_MODE=1)
            specs.add(tuple(spec))
    assert len(specs) == 1, specs  # no value of a size, offset or slot compiles a new variant
    _, spec, _ = binder(
        words[1:], tail, out, *int_values[0], BLOCK=4096, HAS_TAIL=True, SHIFT_MODE=1
    )
    assert tuple(spec) not in specs  # the word pointer's alignment does (see replay.digest.warmup)


def test_kernel_compiles_for_sm90_with_128_bit_loads() -> None:
    triton, GPUTarget, ASTSource, _ = _triton_internals()
    from replay import _digest_triton as k

    fn = k._rd64_kernel
    signature = {
        "words_ptr": "*i32",
        "tail_ptr": "*u8",
        "out_ptr": "*i64",
        **{n: "i64" for n in _INT_ARGS},
    }
    constants = {"BLOCK": 4096, "HAS_TAIL": True, "SHIFT_MODE": 1}
    signature.update({n: "constexpr" for n in constants})
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()},
        attrs={(0,): [["tt.divisibility", 16]]},  # what a 16-byte aligned words tensor gets
    )
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as e:
        if "ptxas" in str(e):
            pytest.skip("no ptxas to assemble with")
        raise
    ptx = compiled.asm["ptx"]
    # 4096 words over 256 threads is 4 vector loads a thread, in the loop and in the extra block.
    assert ptx.count("ld.global.v4.b32") == 8
    assert "atom.global.gpu.relaxed.add.u64" in ptx
    assert "mul.hi.u32" in ptx  # shift_mode 1
