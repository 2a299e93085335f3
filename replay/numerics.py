"""The numerics context of a step: every process-wide setting that changes what the same kernels
compute from the same inputs, read cheaply, compared, and set again on a re-run.

What it holds (a flat, JSON-safe ``{name: value}`` dict; see ``SETTINGS`` for the full list):

* ``grad_enabled``, ``inference_mode``; ``autocast.<device>.enabled`` / ``.dtype``
* ``sdpa.<backend>`` (flash, mem_efficient, math, cudnn, ...) and ``sdpa.priority``: the flags
  an active ``torch.nn.attention.sdpa_kernel`` / ``torch.backends.cuda.sdp_kernel`` context sets
  (a context is recorded by its effect on those flags, which is all it does)
* ``backends.*``: cuDNN enabled/benchmark/deterministic/allow_tf32, cuBLAS TF32, fp16/bf16
  reduced-precision reductions, float32 matmul precision, mkldnn
* ``deterministic.enabled`` / ``.warn_only``, ``default_dtype``, ``num_threads`` (CPU
  reductions split by thread count)
* ``env.<NAME>``: the environment variables in ``ENV_VARS`` (``None`` when unset)

How it is stored in a recording (written by ``replay.record.session``):

* ``attrs["target"]["numerics"] = {"first": DIGEST, "contexts": {DIGEST: CONTEXT, ...}}``: every
  distinct context the rank ran a step under (the target info is written again when a new one
  appears, so the last target frame holds them all).
* each step's JSON arguments hold ``"__numerics__": DIGEST`` (and ``"__stream__": NAME`` in a part
  holding several models; reserved names: a re-run drops
  every argument whose name starts with ``__``, see ``RESERVED_ARGS`` / ``strip_reserved``).
* ``attrs["target"]["launch"]["env_numerics"]``: the ``ENV_VARS`` at the first step.

A re-run reads it back with ``recorded_context(rank_file, step)`` and runs the step inside
``apply(ctx)``; ``differences(recorded, capture())`` says, one line per setting, what differs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from replay.format.reader import RankFile

__all__ = [
    "ENV_VARS",
    "NUMERICS_ARG",
    "RESERVED_ARGS",
    "STREAM_ARG",
    "SETTINGS",
    "apply",
    "capture",
    "context_digest",
    "current",
    "differences",
    "env_numerics",
    "recorded_context",
    "show_setting",
    "step_context_digest",
    "strip_reserved",
]

NUMERICS_ARG = "__numerics__"
STREAM_ARG = "__stream__"
RESERVED_ARGS = (NUMERICS_ARG, STREAM_ARG)

ENV_VARS: tuple[str, ...] = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NTHREADS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_BLAS_PREFER_CUBLASLT",
    "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MKL_CBWR",
)


@dataclass(frozen=True, slots=True)
class Setting:
    """One process-wide setting: how to read it (cheap), its JSON form, and how to set it back.

    ``read`` is a C function (or a ``functools.partial`` of one) where torch has one: the context
    is read after every recorded step, right after the program's own work, when little of the
    recorder's code is in the CPU's caches; there each Python frame costs microseconds (31
    settings read through Python wrappers took ~55 µs a step on a CPU step, ~7 µs warm)."""

    name: str
    read: Callable[[], Any]  # may raise (a getter this build refuses)
    set: Callable[[Any], None] | None
    form: Callable[[Any], Any] | None = None  # the value as recorded, from what ``read`` returns

    def get(self) -> Any:
        """The value as recorded (JSON-safe); None when this build cannot read it."""
        return _formed(self.form, _read_or_none(self.read))


def _formed(form: Callable[[Any], Any] | None, v: Any) -> Any:
    """``v`` in its recorded form; None when the form does not apply (a build whose reader
    returns another shape: torch before 2.10 gives one bool for the cuBLAS reduced-precision
    pair)."""
    if form is None or v is None:
        return v
    try:
        return form(v)
    except Exception:  # noqa: BLE001
        return None


def _none() -> None:
    return None


def _dtype_name(d: Any) -> str | None:
    return str(d) if d is not None else None


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def _set_inference_mode(_v: Any) -> None:
    # Inference mode is entered by a context manager around the call (see ``apply``), never set.
    return None


def _set_autocast_enabled(device: str) -> Callable[[Any], None]:
    return lambda v: torch.set_autocast_enabled(device, bool(v))


def _set_autocast_dtype(device: str) -> Callable[[Any], None]:
    return lambda v: torch.set_autocast_dtype(device, _dtype(v))


C = torch._C
_AUTOCAST_DEVICES = ("cpu", "cuda")
_SDPA = ("flash", "mem_efficient", "math", "cudnn", "fa3", "overrideable")


def _c(name: str) -> Callable[[], Any]:
    """``torch._C.<name>``; where this build lacks it, a reader of None."""
    return getattr(C, name, None) or _none


def _sdpa(name: str) -> Setting:
    return Setting(f"sdpa.{name}", _c(f"_get_{name}_sdp_enabled"), getattr(C, f"_set_sdp_use_{name}", None))


# Whether this thread flushes denormals to zero (``torch.set_flush_denormal``, which has no
# getter): the CPU's flag applies to Python's own float arithmetic too, so a denormal times one
# reads zero under it. Module globals: a constant expression would be folded when compiled.
_DENORMAL, _ONE = 5e-324, 1.0


def _flush_denormal() -> bool:
    return _DENORMAL * _ONE == 0.0


SETTINGS: tuple[Setting, ...] = (
    Setting("grad_enabled", torch.is_grad_enabled, lambda v: torch.set_grad_enabled(bool(v))),
    Setting("inference_mode", torch.is_inference_mode_enabled, _set_inference_mode),
    *(
        s
        for dev in _AUTOCAST_DEVICES
        for s in (
            Setting(f"autocast.{dev}.enabled", functools.partial(torch.is_autocast_enabled, dev), _set_autocast_enabled(dev)),
            Setting(f"autocast.{dev}.dtype", functools.partial(torch.get_autocast_dtype, dev), _set_autocast_dtype(dev), _dtype_name),
        )
    ),
    *(_sdpa(n) for n in _SDPA),
    Setting("sdpa.priority", _c("_get_sdp_priority_order"), lambda v: C._set_sdp_priority_order([int(x) for x in v]), list),
    Setting("sdpa.math_fp16_bf16_reduction", _c("_get_math_sdp_allow_fp16_bf16_reduction"), getattr(C, "_set_math_sdp_allow_fp16_bf16_reduction", None)),
    Setting("backends.cudnn.enabled", C._get_cudnn_enabled, C._set_cudnn_enabled),
    Setting("backends.cudnn.benchmark", C._get_cudnn_benchmark, C._set_cudnn_benchmark),
    Setting("backends.cudnn.deterministic", C._get_cudnn_deterministic, C._set_cudnn_deterministic),
    Setting("backends.cudnn.allow_tf32", C._get_cudnn_allow_tf32, C._set_cudnn_allow_tf32),
    # Precision before the TF32 flag: setting one moves the other, and the recorded pair is
    # consistent, so applying them in this order lands on the recorded pair.
    Setting("backends.float32_matmul_precision", C._get_float32_matmul_precision, torch.set_float32_matmul_precision),
    Setting("backends.cuda.matmul.allow_tf32", C._get_cublas_allow_tf32, C._set_cublas_allow_tf32),
    Setting(
        "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        _c("_get_cublas_allow_fp16_reduced_precision_reduction"),
        lambda v: C._set_cublas_allow_fp16_reduced_precision_reduction(bool(v[0]), bool(v[1])),
        list,
    ),
    Setting(
        "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        _c("_get_cublas_allow_bf16_reduced_precision_reduction"),
        lambda v: C._set_cublas_allow_bf16_reduced_precision_reduction(bool(v[0]), bool(v[1])),
        list,
    ),
    Setting("backends.cuda.matmul.allow_fp16_accumulation", _c("_get_cublas_allow_fp16_accumulation"),
            getattr(C, "_set_cublas_allow_fp16_accumulation", None)),
    Setting("backends.cpu.allow_fp16_reduced_precision_reduction", _c("_get_cpu_allow_fp16_reduced_precision_reduction"),
            getattr(C, "_set_cpu_allow_fp16_reduced_precision_reduction", None)),
    Setting("backends.mkldnn.enabled", C._get_mkldnn_enabled, C._set_mkldnn_enabled),
    Setting("backends.mkldnn.deterministic", _c("_get_mkldnn_deterministic"), getattr(C, "_set_mkldnn_deterministic", None)),
    Setting("deterministic.enabled", C._get_deterministic_algorithms, None),  # set with warn_only, below
    Setting("deterministic.warn_only", C._get_deterministic_algorithms_warn_only, None),
    Setting("deterministic.fill_uninitialized_memory", _c("_get_deterministic_fill_uninitialized_memory"),
            getattr(C, "_set_deterministic_fill_uninitialized_memory", None)),
    Setting("default_dtype", torch.get_default_dtype, lambda v: torch.set_default_dtype(_dtype(v)), str),
    Setting("num_threads", torch.get_num_threads, lambda v: torch.set_num_threads(int(v))),
    Setting("flush_denormal", _flush_denormal, lambda v: torch.set_flush_denormal(bool(v))),
)
_BY_NAME = {s.name: s for s in SETTINGS}
_READS = tuple(s.read for s in SETTINGS)
_FORMS = tuple(s.form for s in SETTINGS)
_NAMES = tuple(s.name for s in SETTINGS)
_ENV_NAMES = tuple(f"env.{v}" for v in ENV_VARS)


def env_numerics() -> dict[str, str | None]:
    """The numerics environment variables of this process (``None``: unset)."""
    env = os.environ
    return {v: env.get(v) for v in ENV_VARS}


# os.environ.get decodes on every call (~1 µs a variable); its backing dict of bytes is read
# directly when there is one (POSIX), and decoded only when a value is set.
_ENV_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(v) for v in ENV_VARS) if _ENV_DATA is not None else ENV_VARS  # type: ignore[attr-defined]


def _env_raw() -> tuple[Any, ...]:
    if _ENV_DATA is None:
        return tuple(map(os.environ.get, ENV_VARS))
    return tuple(map(_ENV_DATA.get, _ENV_KEYS))


def _raw() -> tuple[Any, ...]:
    """Every setting as its reader returns it (a refused one: None), then the environment."""
    try:
        values = [r() for r in _READS]
    except Exception:  # noqa: BLE001 - one reader refused: each on its own (the slow path)
        values = _read_each()
    return (*values, *_env_raw())


def _read_each() -> list[Any]:
    """Each setting on its own. A reader that raised is read through a guard from then on, so
    that a build refusing one setting at every step (a legacy TF32 flag once the fp32_precision
    API was used) keeps the one-pass read for the others; it is still read every time."""
    global _READS
    reads = list(_READS)
    values: list[Any] = []
    for i, read in enumerate(reads):
        try:
            values.append(read())
        except Exception:  # noqa: BLE001
            values.append(None)
            reads[i] = functools.partial(_read_or_none, read)
    _READS = tuple(reads)
    return values


def _read_or_none(read: Callable[[], Any]) -> Any:
    """A getter missing from this build, or refusing (a legacy TF32 flag once the fp32_precision
    API was used), reads as None: not comparable, not set back."""
    try:
        return read()
    except Exception:  # noqa: BLE001
        return None


def _decode(v: Any) -> Any:
    return os.environ.decodevalue(v) if isinstance(v, bytes) else v  # type: ignore[attr-defined]


def _build(raw: tuple[Any, ...]) -> dict[str, Any]:
    n = len(_NAMES)
    values = {k: _formed(f, v) for k, f, v in zip(_NAMES, _FORMS, raw[:n])}
    return {**values, **{k: _decode(v) for k, v in zip(_ENV_NAMES, raw[n:])}}


def capture() -> dict[str, Any]:
    """This thread's numerics context now (JSON-safe)."""
    return _build(_raw())


def context_digest(ctx: dict[str, Any]) -> str:
    """A stable 16-hex-digit hash of ``ctx`` (canonical JSON)."""
    text = json.dumps(ctx, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Cache:
    __slots__ = ("raw", "ctx", "digest")

    def __init__(self) -> None:
        self.raw: tuple[Any, ...] | None = None
        self.ctx: dict[str, Any] = {}
        self.digest = ""


_cache = _Cache()


def current() -> tuple[str, dict[str, Any], bool]:
    """(digest, context, changed since the last call): the per-step form of ``capture``.

    Reading the raw values is a few µs; the dict and its hash are rebuilt only when one of them
    changed, which in a decode loop is almost never."""
    raw = _raw()
    c = _cache
    if raw == c.raw:
        return c.digest, c.ctx, False
    c.raw = raw
    c.ctx = _build(raw)
    c.digest = context_digest(c.ctx)
    return c.digest, c.ctx, True


def _apply_one(name: str, value: Any) -> None:
    if name.startswith("env."):
        var = name[4:]
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = str(value)
        return
    s = _BY_NAME.get(name)
    if s is None or s.set is None or value is None:
        return
    if s.get() == value:
        return
    s.set(value)


@contextlib.contextmanager
def apply(ctx: dict[str, Any]) -> Iterator[list[str]]:
    """Set every setting of ``ctx`` (the re-run's side), restore the previous values on exit.

    Yields the settings that could not be set (unknown names, or a build that refuses them), so a
    re-run can say so instead of comparing under a context it did not reproduce."""
    before = capture()
    failed: list[str] = []
    stack = contextlib.ExitStack()
    try:
        if ctx.get("inference_mode") and not torch.is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode())
        elif ctx.get("inference_mode") is False and torch.is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode(False))
        for name, value in ctx.items():
            if name == "inference_mode" or name.startswith("deterministic."):
                continue
            try:
                _apply_one(name, value)
            except Exception:  # noqa: BLE001
                failed.append(name)
        det = ctx.get("deterministic.enabled")
        if det is not None:
            try:
                torch.use_deterministic_algorithms(bool(det), warn_only=bool(ctx.get("deterministic.warn_only")))
            except Exception:  # noqa: BLE001
                failed.append("deterministic.enabled")
        fill = ctx.get("deterministic.fill_uninitialized_memory")
        if fill is not None:
            try:
                _apply_one("deterministic.fill_uninitialized_memory", fill)
            except Exception:  # noqa: BLE001
                failed.append("deterministic.fill_uninitialized_memory")
        yield failed
    finally:
        stack.close()
        for name, value in before.items():
            if name == "inference_mode" or name.startswith("deterministic."):
                continue
            with contextlib.suppress(Exception):
                _apply_one(name, value)
        with contextlib.suppress(Exception):
            torch.use_deterministic_algorithms(bool(before["deterministic.enabled"]), warn_only=bool(before["deterministic.warn_only"]))
        with contextlib.suppress(Exception):
            _apply_one("deterministic.fill_uninitialized_memory", before["deterministic.fill_uninitialized_memory"])
        _cache.raw = None


def show_setting(v: Any) -> str:
    """A setting's value as a line shows it (JSON; None is "unset")."""
    return "unset" if v is None else json.dumps(v)


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per setting whose value differs: ``"sdpa.flash: recorded false, now true"``.

    A setting only one side knows (another torch version) is listed as such."""
    lines = []
    for name in sorted(set(recorded) | set(current)):
        if name not in current:
            lines.append(f"{name}: recorded {show_setting(recorded[name])}, not known to this torch")
        elif name not in recorded:
            if current[name] is not None:
                lines.append(f"{name}: not recorded, now {show_setting(current[name])}")
        elif recorded[name] != current[name]:
            lines.append(f"{name}: recorded {show_setting(recorded[name])}, now {show_setting(current[name])}")
    return lines


def _step_args(rank_file: "RankFile", step: int) -> dict[str, Any]:
    row = rank_file.step(step).row
    sid = int(row["args"])
    if sid < 0:
        return {}
    try:
        args = json.loads(rank_file.tables.string(sid))
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}


def step_context_digest(rank_file: "RankFile", step: int) -> str | None:
    """The digest of the numerics context step ``step`` ran under, if recorded."""
    d = _step_args(rank_file, step).get(NUMERICS_ARG)
    return d if isinstance(d, str) else None


def recorded_context(rank_file: "RankFile", step: int) -> dict[str, Any] | None:
    """The numerics context step ``step`` of this rank ran under; None when not recorded
    (a recording made before contexts were recorded, or a step without one)."""
    target = rank_file.attrs.get("target") or {}
    numerics = target.get("numerics") if isinstance(target, dict) else None
    if not isinstance(numerics, dict):
        return None
    contexts = numerics.get("contexts") or {}
    d = step_context_digest(rank_file, step)
    ctx = contexts.get(d) if d is not None else None
    return dict(ctx) if isinstance(ctx, dict) else None


def strip_reserved(args: dict[str, Any]) -> dict[str, Any]:
    """A step's recorded arguments without the recorder's reserved ones (``__numerics__``, ...)."""
    return {k: v for k, v in args.items() if not k.startswith("__")}
