"""rd64 on the GPU: a Triton kernel that matches ``replay.digest``'s numpy reference bit for bit.

Private: call it through ``replay.digest`` (``digest``, ``digest_into``, ``DigestBuffer``), which
turns any tensor into the flat, 4-byte aligned bytes this module expects.

Why the result is exact and deterministic: every program sums its mixed words in uint64 lanes,
reduces them to one uint64 and adds that into the output slot with one integer atomic.
Addition modulo 2**64 is associative and commutative, so neither the grid size nor the order in
which programs finish can change a bit of the result.

Why it runs near memory bandwidth:

- a grid of a few programs per SM (no more than fit at once, so there is no second wave) strides
  over blocks of ``block`` words: a 1 GiB tensor costs a few hundred atomics, not one per block;
- full blocks are loaded without a mask, which lets Triton emit 128-bit loads; only the last,
  partial block is masked;
- the position key costs one multiply-add per word: ``lo32(i) * K`` is affine in ``i`` modulo
  2**32; ``hi32(i)`` is one scalar per block because blocks start at multiples of ``block`` (a
  power of two) and so never straddle a multiple of 2**32 words;
- all mixing stays in uint32 (constants are built as uint32 so nothing is promoted to 64 bits);
  the only 64-bit work per word is the accumulate. The mixer saturates the integer ALU (about 16
  ALU instructions a word), so ``shift_mode`` can move right shifts onto the FMA pipe as
  multiply-high instructions, which compute the same bits.

Capture: a launch allocates nothing and never syncs, so it can run inside ``torch.cuda.graph``.
Launch once eagerly first (``replay.digest.warmup``): compiling loads a module, which a capture
does not allow, and the first launch measures how many programs fit on an SM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["KernelConfig", "DEFAULT_CONFIG", "accumulate_digest", "accumulate_word_sum"]

# The constants of the definition in ``replay.digest``. Kernels may only read constexpr globals;
# each use wraps them in ``tl.full(..., tl.uint32)`` so the arithmetic stays in uint32.
_K_POS_LO = tl.constexpr(0x9E3779B1)
_K_POS_HI = tl.constexpr(0x7FEB352D)
_K_HI_LANE = tl.constexpr(0x632BE5AB)
_M1 = tl.constexpr(0x85EBCA6B)
_M2 = tl.constexpr(0xC2B2AE35)
_K_LEN = 0x9E3779B97F4A7C15  # host side only: the length term reaches the kernel as ``extra``
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch shape of the rd64 kernel. Every value gives the same digest; only speed differs."""

    # The defaults are the fastest shape of ``bench_digest.py --sweep`` on an H200 (3.55 TB/s for
    # 1 GiB, against 2.80 for 4096/8/4/1; benchmarks/RESULTS.md).
    block: int = 8192
    """Words a program reads per loop iteration; a power of two (the position keys rely on it)."""
    num_warps: int = 8
    """Warps per program."""
    programs_per_sm: int = 2
    """Most programs per SM; fewer are launched when fewer fit at once (no second wave)."""
    shift_mode: int = 0
    """Right shifts done as multiply-high: 0 none, 1 the ``>> 16`` ones, 2 all."""

    def __post_init__(self) -> None:
        if self.block < 16 or self.block > 1 << 20 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two in [16, 2**20], got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two up to 32, got {self.num_warps}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.shift_mode not in (0, 1, 2):
            raise ValueError(f"shift_mode must be 0, 1 or 2, got {self.shift_mode}")


DEFAULT_CONFIG = KernelConfig()


@triton.jit
def _shr(x, s: tl.constexpr, MULHI: tl.constexpr):
    # x >> s == umulhi(x, 2**(32 - s)) for every uint32 x: the same bits from another pipe.
    if MULHI:
        return tl.umulhi(x, tl.full((), 1 << (32 - s), tl.uint32))
    else:
        return x >> s


@triton.jit
def _fmix32(x, SHIFT_MODE: tl.constexpr):
    # MurmurHash3's finalizer; x is uint32, so >> is a logical shift and * wraps modulo 2**32.
    x ^= _shr(x, 16, SHIFT_MODE >= 1)
    x *= tl.full((), _M1, tl.uint32)
    x ^= _shr(x, 13, SHIFT_MODE >= 2)
    x *= tl.full((), _M2, tl.uint32)
    x ^= _shr(x, 16, SHIFT_MODE >= 1)
    return x


@triton.jit
def _mix64(w, key, SHIFT_MODE: tl.constexpr):
    """The 64-bit value a word ``w`` contributes, given its position key (both uint32)."""
    x = w ^ key
    lo = _fmix32(x, SHIFT_MODE)
    hi = _fmix32(x + tl.full((), _K_HI_LANE, tl.uint32), SHIFT_MODE)
    return (hi.to(tl.uint64) << 32) | lo.to(tl.uint64)


@triton.jit
def _key_parts(index):
    """``(lo32(index) * K_LO, hi32(index) * K_HI)`` for an int64 word index, as uint32."""
    index = index.to(tl.int64)
    lo = (index & 0xFFFFFFFF).to(tl.uint32) * tl.full((), _K_POS_LO, tl.uint32)
    hi = (index >> 32).to(tl.uint32) * tl.full((), _K_POS_HI, tl.uint32)
    return lo, hi


@triton.jit
def _full_block(words_ptr, start, first, koff, BLOCK: tl.constexpr, SHIFT_MODE: tl.constexpr):
    """Mixed values of the full block of words at ``start`` (no mask, so loads vectorise)."""
    w = tl.load(words_ptr + start + tl.arange(0, BLOCK)).to(tl.uint32, bitcast=True)
    # key(j) = lo32(first + start + j) * K_LO ^ hi32(first + start) * K_HI, and the first
    # product is lo32(first + start) * K_LO + j * K_LO modulo 2**32.
    c, h = _key_parts(first + start)
    return _mix64(w, (koff + c) ^ h, SHIFT_MODE)


# The integer arguments vary from call to call. Their types are fixed (a Python int is otherwise
# typed i32 or i64 by its value) and they are not specialised on (value 1, divisibility by 16),
# so no new variant is compiled at run time, which a graph capture would not allow. The tail and
# output pointers move by a few bytes between calls for the same reason; only the words pointer
# keeps its alignment specialisation, which the 128-bit loads need.
@triton.jit(
    do_not_specialize=[
        "tail_ptr",
        "out_ptr",
        "slot",
        "n_words",
        "n_blocks",
        "n_iter",
        "n_tail",
        "first_index",
        "extra",
    ]
)
def _rd64_kernel(
    words_ptr,  # *int32 [n_words]: the full 4-byte words, read as uint32
    tail_ptr,  # *uint8 [n_tail]: bytes after the last full word (read only when HAS_TAIL)
    out_ptr,  # *int64: the output vector; the result is added into out_ptr[slot]
    slot: tl.int64,
    n_words: tl.int64,
    n_blocks: tl.int64,  # n_words // BLOCK: blocks read without a mask
    n_iter: tl.int64,  # n_blocks // num_programs: full blocks every program reads
    n_tail: tl.int64,  # 1..3 when HAS_TAIL
    first_index: tl.int64,  # word index of words_ptr[0]; a multiple of BLOCK
    extra: tl.int64,  # added once, as two's complement int64 (the length term)
    BLOCK: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    SHIFT_MODE: tl.constexpr,
):
    # The annotations fix the types when compiled; Triton's interpreter ignores them, so widen
    # explicitly (a no-op when compiled) to keep index arithmetic in 64 bits in both.
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    first = first_index.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    koff = offs.to(tl.uint32) * tl.full((), _K_POS_LO, tl.uint32)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    # Grid-stride loop whose trip count is the same for every program, then at most one more
    # full block for the first programs.
    for i in range(0, n_iter):
        acc += _full_block(words_ptr, (pid + i * nprog) * BLOCK, first, koff, BLOCK, SHIFT_MODE)
    b = pid + n_iter.to(tl.int64) * nprog
    if b < n_blocks:
        acc += _full_block(words_ptr, b * BLOCK, first, koff, BLOCK, SHIFT_MODE)
    total = tl.sum(acc, axis=0)

    # The last program also takes the partial block, the tail bytes and the length term: it is
    # one that read no extra full block above.
    if pid == nprog - 1:
        start = n_blocks.to(tl.int64) * BLOCK
        mask = offs < n_words.to(tl.int64) - start
        w = tl.load(words_ptr + start + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        c, h = _key_parts(first + start)
        part = tl.where(
            mask, _mix64(w, (koff + c) ^ h, SHIFT_MODE), tl.zeros([BLOCK], dtype=tl.uint64)
        )
        total += tl.sum(part, axis=0)
        if HAS_TAIL:
            # Little-endian word of the 1..3 trailing bytes, zero-padded like the reference.
            j = tl.arange(0, 4)
            tb = tl.load(tail_ptr + j, mask=j < n_tail, other=0).to(tl.uint32)
            word = tl.sum(tb << (j * 8).to(tl.uint32), axis=0)
            tc, th = _key_parts(first + n_words.to(tl.int64))
            total += _mix64(word, tc ^ th, SHIFT_MODE)
        total += extra.to(tl.int64).to(tl.uint64, bitcast=True)

    tl.atomic_add(out_ptr + slot, total.to(tl.int64, bitcast=True), sem="relaxed")


# One entry per compiled variant, (device index, config, has tail, words 16-byte aligned) ->
# programs per SM that fit at once, learnt from its first launch (the register count is known
# only once the kernel is loaded).
_fit_per_sm: dict[tuple[int, KernelConfig, bool, bool], int] = {}
_sm_counts: dict[int, int] = {}


def _sm_count(device_index: int) -> int:
    if device_index not in _sm_counts:
        _sm_counts[device_index] = torch.cuda.get_device_properties(
            device_index
        ).multi_processor_count
    return _sm_counts[device_index]


def _programs_that_fit(kernel: object, device_index: int, num_warps: int) -> int | None:
    """Programs of ``kernel`` resident on one SM at once, from its registers and shared memory."""
    regs = getattr(kernel, "n_regs", 0)
    if not regs:
        return None
    props = torch.cuda.get_device_properties(device_index)
    threads = 32 * num_warps
    # Registers are allocated per warp in units of 256 (8 per thread).
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (-(-regs // 8) * 8 * threads)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    shared = (
        getattr(getattr(kernel, "metadata", None), "shared", 0) + 1024
    )  # 1 KiB reserved per CTA
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared
    return max(1, min(32, by_regs, by_threads, by_shared))


def _to_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _check_out(out: torch.Tensor, index: int, device: torch.device) -> int:
    """Element offset of ``out[index]``, after checking ``out`` can take a digest there."""
    if out.dtype != torch.int64 or out.dim() != 1:
        raise TypeError(
            f"out must be a 1-D torch.int64 tensor, got {out.dtype} with shape {tuple(out.shape)}"
        )
    if out.device != device:
        raise ValueError(
            f"out is on {out.device} but the tensor is on {device}; put both on one device"
        )
    if not 0 <= index < out.shape[0]:
        raise IndexError(f"index {index} is out of range for out of length {out.shape[0]}")
    return index * out.stride(0)


def _launch(
    words: torch.Tensor,
    tail: torch.Tensor | None,
    out: torch.Tensor,
    slot: int,
    first_index: int,
    extra: int,
    config: KernelConfig,
    grid: int | None,
) -> None:
    n_words = words.numel()
    n_blocks = n_words // config.block
    key: tuple[int, KernelConfig, bool, bool] | None = None
    if grid is None:
        if words.device.type == "cuda":
            index = (
                words.device.index
                if words.device.index is not None
                else torch.cuda.current_device()
            )
            key = (index, config, tail is not None, words.data_ptr() % 16 == 0)
            # Before the first launch the fit is unknown; one program per SM always fits.
            per_sm = _fit_per_sm.get(key, 1)
            grid = _sm_count(index) * per_sm
        else:
            grid = 4  # TRITON_INTERPRET=1 runs on CPU tensors; any small grid runs the same code
        grid = max(1, min(grid, n_blocks))
    args = (words, tail, out, slot, n_words, n_blocks, grid, first_index, extra, config)
    if words.device.type == "cuda":
        # Triton launches on the current device; a tensor on another GPU must not run there.
        with torch.cuda.device(words.device):
            kernel = _launch_kernel(*args)
    else:
        kernel = _launch_kernel(*args)
    if key is not None and key not in _fit_per_sm:
        fit = _programs_that_fit(kernel, key[0], config.num_warps)
        _fit_per_sm[key] = min(config.programs_per_sm, fit) if fit else 1


def _launch_kernel(
    words: torch.Tensor,
    tail: torch.Tensor | None,
    out: torch.Tensor,
    slot: int,
    n_words: int,
    n_blocks: int,
    grid: int,
    first_index: int,
    extra: int,
    config: KernelConfig,
) -> object:
    return _rd64_kernel[(grid,)](
        words,
        tail if tail is not None else words,
        out,
        slot,
        n_words,
        n_blocks,
        n_blocks // grid,
        tail.numel() if tail is not None else 0,
        first_index,
        _to_int64(extra),
        BLOCK=config.block,
        HAS_TAIL=tail is not None,
        SHIFT_MODE=config.shift_mode,
        num_warps=config.num_warps,
    )


def accumulate_digest(
    flat: torch.Tensor,
    out: torch.Tensor,
    index: int,
    *,
    config: KernelConfig = DEFAULT_CONFIG,
    grid: int | None = None,
) -> None:
    """Add the rd64 digest of ``flat`` into ``out[index]`` (as int64 bits); no sync, no allocation.

    ``flat`` is a 1-D contiguous uint8 tensor whose first byte is 4-byte aligned (in memory and
    as a storage offset, so that it can be viewed as int32). ``out[index]`` must hold zero
    beforehand for it to end up holding the digest. ``grid`` overrides the number of programs
    (tests use it to force many loop iterations).
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise TypeError("flat must be a 1-D contiguous torch.uint8 tensor")
    if flat.numel() and (flat.data_ptr() % 4 or flat.storage_offset() % 4):
        raise ValueError("flat must start 4-byte aligned in memory and in its storage; .clone() it")
    slot = _check_out(out, index, flat.device)
    n = flat.numel()
    if n == 0:
        return  # the digest of no bytes is 0: nothing to add
    n_full = n // 4
    words = flat[: n_full * 4].view(torch.int32)  # [n_full]
    tail = flat[n_full * 4 :] if n % 4 else None  # [n % 4]
    _launch(words, tail, out, slot, 0, n * _K_LEN, config, grid)


def accumulate_word_sum(
    words: torch.Tensor,
    out: torch.Tensor,
    index: int,
    first_index: int,
    *,
    config: KernelConfig = DEFAULT_CONFIG,
    grid: int | None = None,
) -> None:
    """Add the sum of mixed words (the reference's ``_sum_words(words, first_index)``) into
    ``out[index]``: no tail, no length term.

    It lets tests reach word indices past 2**32 (the ``hi32(i)`` key term) with a small tensor.
    ``first_index`` must be a multiple of ``config.block``.
    """
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise TypeError("words must be a 1-D contiguous torch.int32 tensor")
    if first_index < 0 or first_index % config.block:
        raise ValueError(
            f"first_index must be a non-negative multiple of {config.block}, got {first_index}"
        )
    slot = _check_out(out, index, words.device)
    if words.numel():
        _launch(words, None, out, slot, first_index, 0, config, grid)
