"""A 64-bit digest of a tensor's bits: ``rd64``.

Why not ``torch.hash_tensor``: it XORs 64-bit words, so it cannot see elements that swap places
and lets equal pairs cancel. ``rd64`` keys every 32-bit word with its position before mixing, and
sums the mixed words modulo 2**64. Integer addition is associative and commutative, so the result
does not depend on reduction order: the same bits give the same digest on CPU and GPU, for any
launch configuration. Because the mix is a bijection of the word for a fixed position, flipping
any bit always changes the digest; a swap of two different elements changes it with probability
1 - 2**-64.

Definition (the numpy code below is the reference; every other implementation must match it):

- ``b`` is the tensor's bytes in row-major order (as ``t.contiguous()`` lays them out), ``n = len(b)``.
- ``w[i]`` is the little-endian uint32 at bytes ``4i..4i+3``; the last word is zero-padded.
- with all arithmetic on uint32 modulo 2**32:
  ``x = w[i] ^ (lo32(i) * 0x9E3779B1) ^ (hi32(i) * 0x7FEB352D)``,
  ``lo = fmix32(x)``, ``hi = fmix32(x + 0x632BE5AB)``,
  where fmix32 is MurmurHash3's finalizer.
- ``digest = (sum_i (hi << 32 | lo) + n * 0x9E3779B97F4A7C15) mod 2**64``.

Using it (full text in ``docs/digest.md``): ``digest(t)`` returns the value as a Python int;
``digest_into(t, out, index)`` and ``DigestBuffer`` write it on the device, inside a CUDA graph if
need be. A digest in an int64 tensor holds the same 64 bits in two's complement:
``from_int64(v)`` turns it back into [0, 2**64), ``to_int64(d)`` goes the other way.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from types import ModuleType

import numpy as np
from typing import TYPE_CHECKING

from replay._lazy import LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch", globals())

from replay.log import get_logger

__all__ = [
    "DigestBuffer",
    "digest",
    "digest_bytes",
    "digest_into",
    "digest_many",
    "digest_numpy",
    "format_digest",
    "from_int64",
    "local_tensor",
    "to_int64",
    "warmup",
]

_log = get_logger(__name__)

_K_POS_LO = np.uint32(0x9E3779B1)
_K_POS_HI = np.uint32(0x7FEB352D)
_K_HI_LANE = np.uint32(0x632BE5AB)
_K_LEN = 0x9E3779B97F4A7C15
_M1 = np.uint32(0x85EBCA6B)
_M2 = np.uint32(0xC2B2AE35)
_MASK64 = (1 << 64) - 1
# Words per chunk: large enough to amortise numpy's per-call cost, small enough to stay in cache.
_CHUNK_WORDS = 1 << 18

# --- The reference: the definition above, in numpy, kept plain. Every fast path must match it.


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * _M1
    x = x ^ (x >> np.uint32(13))
    x = x * _M2
    return x ^ (x >> np.uint32(16))


def _sum_words(words: np.ndarray, first_index: int) -> int:
    """Sum of the mixed words ``words`` whose first word has index ``first_index`` (mod 2**64)."""
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK_WORDS):
            w = words[start : start + _CHUNK_WORDS]
            idx = np.arange(first_index + start, first_index + start + w.size, dtype=np.uint64)
            key = (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32) * _K_POS_LO
            key ^= (idx >> np.uint64(32)).astype(np.uint32) * _K_POS_HI
            x = w ^ key
            lo = _fmix32(x).astype(np.uint64)
            hi = _fmix32(x + _K_HI_LANE).astype(np.uint64)
            total += int(((hi << np.uint64(32)) | lo).sum(dtype=np.uint64))
    return total & _MASK64


def _digest_numpy_reference(buf: np.ndarray) -> int:
    """The reference: ``digest_numpy`` written as plainly as the definition."""
    raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    n = raw.size
    if n == 0:
        return 0
    n_full = n // 4
    total = _sum_words(raw[: n_full * 4].view("<u4"), 0) if n_full else 0
    if n % 4:
        tail = np.zeros(4, dtype=np.uint8)
        tail[: n % 4] = raw[n_full * 4 :]
        total += _sum_words(tail.view("<u4"), n_full)
    return (total + n * _K_LEN) & _MASK64


# --- The CPU path: the same digest, about six times faster than the reference.
#
# Each step runs in place on preallocated uint32 buffers that stay in cache, both fmix32 lanes go
# through one call each, and the position keys come from a precomputed ``j * K_LO`` plus one
# scalar per chunk. The sums stay in uint32 too (numpy's uint32 -> uint64 reduction costs four
# times a uint32 one, and would be a third of the time):
#
# - only sum(hi) mod 2**32 matters, since hi is shifted up by 32 bits;
# - sum(lo) needs every bit. fmix32's last step is ``lo = a ^ (a >> 16)`` with ``t = a >> 16``,
#   so ``lo >> 16 == t``, which is left over in the scratch buffer; with at most 2**16 words a
#   chunk, both sum(t) and sum(lo & 0xFFFF) fit in 32 bits, and sum(lo) mod 2**32 gives the
#   second from the first.

_FAST_CHUNK = 1 << 16  # must stay <= 2**16, see above; 2**16 is also the fastest measured


@functools.cache
def _key_offsets() -> np.ndarray:
    """``j * K_LO mod 2**32`` for j in [0, _FAST_CHUNK)."""
    with np.errstate(over="ignore"):
        return np.arange(_FAST_CHUNK, dtype=np.uint32) * _K_POS_LO


def _fmix32_inplace(x: np.ndarray, t: np.ndarray) -> None:
    """``x = fmix32(x)`` in place, ``t`` scratch; on return ``t == x >> 16``."""
    np.right_shift(x, 16, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _M1, out=x)
    np.right_shift(x, 13, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _M2, out=x)
    np.right_shift(x, 16, out=t)
    np.bitwise_xor(x, t, out=x)


def _sum_words_fast(words: np.ndarray, first_index: int) -> int:
    """``_sum_words(words, first_index)``, computed faster."""
    n = words.size
    lanes = np.empty(2 * min(n, _FAST_CHUNK), dtype=np.uint32)  # [lo lane | hi lane]
    scratch = np.empty_like(lanes)
    koff = _key_offsets()
    total = 0
    start = 0
    while start < n:
        i = first_index + start
        # A chunk never crosses a multiple of 2**32 words, so hi32(i) is one scalar in it.
        m = min(_FAST_CHUNK, n - start, (1 << 32) - (i & 0xFFFFFFFF))
        x, y, t = lanes[:m], lanes[m : 2 * m], scratch[: 2 * m]
        # lo32(i + j) * K_LO == lo32(i) * K_LO + j * K_LO (mod 2**32)
        np.add(koff[:m], np.uint32((i * 0x9E3779B1) & 0xFFFFFFFF), out=x)
        hi_key = ((i >> 32) * 0x7FEB352D) & 0xFFFFFFFF
        if hi_key:
            np.bitwise_xor(x, np.uint32(hi_key), out=x)
        np.bitwise_xor(x, words[start : start + m], out=x)
        np.add(x, _K_HI_LANE, out=y)
        _fmix32_inplace(lanes[: 2 * m], t)  # x is now lo, y is hi, t[:m] is lo >> 16
        sum_hi = int(np.add.reduce(y, dtype=np.uint32))
        sum_top = int(np.add.reduce(t[:m], dtype=np.uint32))  # exact: < 2**16 * 2**16
        sum_low = (int(np.add.reduce(x, dtype=np.uint32)) - (sum_top << 16)) & 0xFFFFFFFF
        total += sum_low + (sum_top << 16) + (sum_hi << 32)
        start += m
    return total & _MASK64


def digest_numpy(buf: np.ndarray) -> int:
    """Digest of the raw bytes of a C-contiguous numpy array (any dtype)."""
    raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    n = raw.size
    n_full = n // 4
    # numpy reads unaligned words correctly (if more slowly), so no copy is needed here.
    total = _sum_words_fast(raw[: n_full * 4].view("<u4"), 0) if n_full else 0
    if n % 4:
        tail = np.zeros(4, dtype=np.uint8)
        tail[: n % 4] = raw[n_full * 4 :]
        total += _sum_words_fast(tail.view("<u4"), n_full)
    return (total + n * _K_LEN) & _MASK64


# A batch of ``digest_numpy_many`` holds at most this many words; each of its arrays at most
# ``_FAST_CHUNK`` words, so that its three uint32 sums are exact as in ``_sum_words_fast``.
_MANY_WORDS = 1 << 16


class _ManyScratch(threading.local):
    """Buffers of ``digest_numpy_many``, one set per thread, kept: the drain digests a step's
    small tensors every step, and fresh temporaries of a few hundred KiB each call cost page
    faults (the allocator returns them to the kernel) and more passes than the sums need."""

    def __init__(self) -> None:
        self.lanes = np.empty(2 * _MANY_WORDS, dtype=np.uint32)  # [x | y]: the two fmix32 lanes
        self.scratch = np.empty(2 * _MANY_WORDS, dtype=np.uint32)


_many_scratch = _ManyScratch()


def digest_numpy_many(bufs: list[np.ndarray]) -> list[int]:
    """Digests of many small arrays in one vectorised pass (a step's inputs, tokens, logits).

    Equal to ``[digest_numpy(b) for b in bufs]``; the point is to pay numpy's per-call cost once
    per step instead of once per tensor. Arrays of more than ``_FAST_CHUNK`` words go to
    ``digest_numpy``; the others are mixed together in batches of at most ``_MANY_WORDS`` words,
    each word keyed by its position in its own array, and summed per array with ``reduceat``."""
    out = [0] * len(bufs)
    batch: list[tuple[int, np.ndarray]] = []
    words = 0
    for i, b in enumerate(bufs):
        raw = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        n = (raw.size + 3) // 4
        if n > _FAST_CHUNK:
            out[i] = digest_numpy(raw)
            continue
        if n == 0:
            continue  # an empty array digests to 0
        if words + n > _MANY_WORDS:
            _digest_batch(batch, words, out)
            batch, words = [], 0
        batch.append((i, raw))
        words += n
    if batch:
        _digest_batch(batch, words, out)
    return out


def _digest_batch(batch: list[tuple[int, np.ndarray]], total: int, out: list[int]) -> None:
    """``out[i] = digest_numpy(raw)`` for each (i, raw) of ``batch`` (``total`` words in all)."""
    sc = _many_scratch
    koff = _key_offsets()
    x, y = sc.lanes[:total], sc.lanes[total : 2 * total]
    starts = []
    at = 0
    for _, raw in batch:
        n_full = raw.size // 4
        if n_full:
            # x = w ^ (j * K_LO): j is the word's index in its own array (< 2**16: hi32(j) = 0).
            np.bitwise_xor(koff[:n_full], raw[: n_full * 4].view("<u4"), out=x[at : at + n_full])
        if raw.size % 4:
            tail = np.zeros(4, dtype=np.uint8)
            tail[: raw.size % 4] = raw[n_full * 4 :]
            x[at + n_full] = koff[n_full] ^ tail.view("<u4")[0]
        starts.append(at)
        at += (raw.size + 3) // 4
    with np.errstate(over="ignore"):
        np.add(x, _K_HI_LANE, out=y)
    _fmix32_inplace(sc.lanes[: 2 * total], sc.scratch[: 2 * total])  # x is lo, y is hi, scratch[:total] is lo >> 16
    idx = np.array(starts, dtype=np.intp)
    sum_hi = np.add.reduceat(y, idx, dtype=np.uint32).tolist()
    sum_top = np.add.reduceat(sc.scratch[:total], idx, dtype=np.uint32).tolist()  # exact: < 2**16 * 2**16
    sum_lo = np.add.reduceat(x, idx, dtype=np.uint32).tolist()
    for k, (i, raw) in enumerate(batch):
        low = (sum_lo[k] - (sum_top[k] << 16)) & 0xFFFFFFFF
        out[i] = (low + (sum_top[k] << 16) + (sum_hi[k] << 32) + raw.size * _K_LEN) & _MASK64


def digest_bytes(data: bytes | bytearray | memoryview) -> int:
    """Digest of a byte string, equal to the digest of a uint8 tensor holding those bytes."""
    return digest_numpy(np.frombuffer(data, dtype=np.uint8))


# --- Tensors.


def to_int64(d: int) -> int:
    """The digest ``d`` in [0, 2**64) as the signed int64 with the same bits (for int64 storage)."""
    d &= _MASK64
    return d - (1 << 64) if d >> 63 else d


def from_int64(v: int) -> int:
    """A digest read from an int64 tensor or column, back in [0, 2**64)."""
    return v & _MASK64


def format_digest(d: int) -> str:
    """Sixteen hex digits, the form the CLI and the reports show."""
    return f"{d & _MASK64:016x}"


def _flat_bytes(t: torch.Tensor, aligned: bool = True) -> torch.Tensor:
    """``t``'s bytes in row-major order as a 1-D uint8 tensor on ``t``'s device; when
    ``aligned``, starting on a 4-byte boundary (copied if need be), as the GPU kernel needs."""
    if t.layout != torch.strided:
        raise TypeError(
            f"digest needs a dense tensor, got layout {t.layout}; call .to_dense() first"
        )
    # Conjugate and negative views are lazy: their bits in memory are not the values they show.
    t = t.detach().resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    if aligned and flat.numel() and (flat.data_ptr() % 4 or flat.storage_offset() % 4):
        # A view that starts mid-word: word loads need an aligned start, and torch's int32 view
        # needs an offset that is a multiple of 4 (they differ for a misaligned foreign buffer).
        flat = flat.clone()
    return flat


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    flat = _flat_bytes(t, aligned=False)  # numpy reads unaligned words
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # A uint8 view keeps every dtype (bf16, fp8, bool) representable in numpy.
    return flat.numpy()


@functools.cache
def _triton_backend() -> ModuleType | None:
    """The Triton kernel module, or None (logged once) where Triton cannot be imported."""
    try:
        from replay import _digest_triton
    except Exception as e:  # ImportError, or a Triton that fails to initialise its driver
        _log.warning(
            "Triton is not usable (%s): CUDA tensors are digested on the CPU, with a host sync, "
            "and digest_into cannot be captured in a CUDA graph; install triton to fix",
            e,
        )
        return None
    return _digest_triton


def _gpu_backend(t: torch.Tensor) -> ModuleType | None:
    return _triton_backend() if t.device.type == "cuda" else None


def _check_slot(out: torch.Tensor, index: int) -> None:
    if out.dtype != torch.int64 or out.dim() != 1:
        raise TypeError(
            f"out must be a 1-D torch.int64 tensor, got {out.dtype} with shape {tuple(out.shape)}"
        )
    if not 0 <= index < out.shape[0]:
        raise IndexError(f"index {index} is out of range for out of length {out.shape[0]}")


def _write_on_host(t: torch.Tensor, out: torch.Tensor, index: int) -> None:
    """Digest on the host and store the value: eager only, since it syncs and bakes in a value."""
    if out.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        where = (
            "is on the CPU" if t.device.type != "cuda" else "needs Triton, which is not importable"
        )
        raise RuntimeError(
            f"cannot digest inside a CUDA graph capture: the tensor {where}; "
            "digest a CUDA tensor, with triton installed, to capture it"
        )
    out[index] = to_int64(digest(t))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bits this process holds: a DTensor's local shard, anything else as is.

    Never ``full_tensor()``: gathering would add a collective to the program's sequence (and
    hang if only some ranks made it); a replicated DTensor's local tensor is the whole tensor."""
    if type(t) is not torch.Tensor and callable(getattr(type(t), "to_local", None)):
        return t.to_local()
    return t


def digest(t: torch.Tensor) -> int:
    """The rd64 digest of ``t``'s bits as a Python int in [0, 2**64).

    CUDA tensors are digested on their GPU (one host sync for the result); others on the CPU.
    A DTensor is digested by its local shard (``local_tensor``).
    """
    t = local_tensor(t)
    gpu = _gpu_backend(t)
    if gpu is None:
        return digest_numpy(_tensor_bytes(t))
    out = torch.zeros(1, dtype=torch.int64, device=t.device)
    gpu.accumulate_digest(_flat_bytes(t), out, 0)
    return from_int64(int(out.item()))


def digest_into(t: torch.Tensor, out: torch.Tensor, index: int = 0) -> None:
    """Write the digest of ``t`` into ``out[index]`` (a 1-D int64 tensor), as int64 bits.

    For a CUDA tensor it runs on the GPU without a host sync or an allocation that a capture
    cannot make, so it can be captured in a CUDA graph: each replay digests the tensor's contents
    at that time. Run it once before capturing (or call ``warmup``) so the kernel is compiled.
    For a CPU tensor it computes eagerly and stores the value. Read it with ``from_int64``.
    """
    _check_slot(out, index)
    gpu = _gpu_backend(t)
    if gpu is None:
        _write_on_host(t, out, index)
        return
    if out.device != t.device:
        raise ValueError(
            f"out is on {out.device} but the tensor is on {t.device}; put both on one device"
        )
    flat = _flat_bytes(t)
    out[index].zero_()  # the kernel adds into the slot; a captured fill, not a host write
    gpu.accumulate_digest(flat, out, index)


def digest_many(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The digests of many tensors, in order, with one host sync per GPU rather than per tensor."""
    tensors = list(tensors)
    result = [0] * len(tensors)
    on_gpu: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if _gpu_backend(t) is not None:
            on_gpu.setdefault(t.device, []).append(i)
        else:
            result[i] = digest(t)
    for device, positions in on_gpu.items():
        gpu = _triton_backend()
        assert gpu is not None  # only CUDA tensors with a backend were grouped
        out = torch.zeros(len(positions), dtype=torch.int64, device=device)  # [len(positions)]
        for slot, i in enumerate(positions):
            gpu.accumulate_digest(_flat_bytes(tensors[i]), out, slot)
        for i, v in zip(positions, out.tolist(), strict=True):
            result[i] = from_int64(v)
    return result


class DigestBuffer:
    """Digest slots in one int64 tensor on a device, for recorders.

    Filled inside a step (captured in a CUDA graph or not), read after it with one sync::

        buf = DigestBuffer(3, device="cuda")
        buf.clear()                 # once per step, before the puts (captured with them)
        buf.put(0, logits)
        buf.put(1, hidden)
        ...                         # after the step (or the graph's replay):
        buf.read()                  # [d0, d1, 0], Python ints in [0, 2**64)

    ``put`` adds into its slot, so each slot must have been cleared since it was last filled.
    ``values`` is the int64 tensor itself, for copying out asynchronously.
    """

    def __init__(self, slots: int, device: torch.device | str | int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a DigestBuffer needs at least one slot, got {slots}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self.values = torch.zeros(slots, dtype=torch.int64, device=device)  # [slots]

    def __len__(self) -> int:
        return self.values.shape[0]

    def clear(self) -> None:
        """Zero every slot (one captured fill on a GPU)."""
        self.values.zero_()

    def put(self, index: int, t: torch.Tensor) -> None:
        """Digest ``t`` into slot ``index``, which must be clear; capturable for CUDA tensors."""
        _check_slot(self.values, index)
        gpu = _gpu_backend(t)
        if gpu is None:
            _write_on_host(t, self.values, index)
            return
        if self.values.device != t.device:
            raise ValueError(
                f"the buffer is on {self.values.device} but the tensor is on {t.device}"
            )
        gpu.accumulate_digest(_flat_bytes(t), self.values, index)

    def read(self) -> list[int]:
        """Every slot as a Python int in [0, 2**64); syncs with the current stream once."""
        return [from_int64(v) for v in self.values.tolist()]


def warmup(device: torch.device | str | int | None = None) -> None:
    """Compile and load the GPU kernel's variants on ``device`` before a CUDA graph capture.

    A capture cannot compile or load a kernel. This launches each variant the digest can use
    (word data 16-byte aligned or not, with and without 1-3 trailing bytes), so any later
    ``digest_into`` or ``DigestBuffer.put`` may be captured. A no-op without Triton.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device is None
        else torch.device(device)
    )
    if device.type != "cuda":
        return
    gpu = _triton_backend()
    if gpu is None:
        return
    words = 2 * gpu.DEFAULT_CONFIG.block + 3  # full blocks and a partial one
    raw = torch.zeros(4 * words + 16, dtype=torch.uint8, device=device)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    for offset in (0, 4):  # 16-byte aligned words, then only 4-byte aligned
        for n in (4 * words, 4 * words + 1):
            gpu.accumulate_digest(raw[offset : offset + n], out, 0)
    torch.cuda.synchronize(device)
