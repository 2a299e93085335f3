"""Comparisons that return verdicts, not booleans.

A ``Comparison`` says whether two results are bitwise equal, within tolerance, or different, and
carries the figures an engineer asks for next: max abs and relative error, ULP distance, argmax
agreement, top-k overlap and the top-1/top-2 margin. It prints as one line.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from replay.digest import digest, format_digest

__all__ = ["Verdict", "Comparison", "compare_tensors", "compare_digests", "top2_margin", "ulp_distance"]


class Verdict(enum.Enum):
    BITWISE_EQUAL = "bitwise equal"
    WITHIN_TOLERANCE = "within tolerance"
    DIFFERENT = "different"

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class Comparison:
    a: str
    b: str
    verdict: Verdict
    max_abs: float | None = None
    max_rel: float | None = None
    ulp: int | None = None
    argmax_agree: float | None = None  # fraction of rows whose argmax agrees
    topk_overlap: float | None = None  # mean |top-k(a) & top-k(b)| / k over rows
    margin: float | None = None  # min top-1/top-2 margin of ``a`` over rows
    mismatched: int | None = None  # number of elements whose bits differ
    numel: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # The tolerance the values were judged by (floats that differ in bits only): "within
    # tolerance" means nothing without it.
    rtol: float | None = None
    atol: float | None = None

    @property
    def equal(self) -> bool:
        return self.verdict is Verdict.BITWISE_EQUAL

    @property
    def verdict_text(self) -> str:
        """The verdict, with the tolerance it was judged by where one was."""
        if self.rtol is None or self.atol is None or self.verdict is Verdict.BITWISE_EQUAL:
            return str(self.verdict)
        return f"{self.verdict} (rtol {self.rtol:g}, atol {self.atol:g})"

    def to_json(self) -> dict[str, Any]:
        d = {
            "a": self.a,
            "b": self.b,
            "verdict": str(self.verdict),
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "ulp": self.ulp,
            "argmax_agree": self.argmax_agree,
            "topk_overlap": self.topk_overlap,
            "margin": self.margin,
            "mismatched": self.mismatched,
            "numel": self.numel,
        }
        if self.rtol is not None:
            d["rtol"], d["atol"] = self.rtol, self.atol
        if self.note:
            d["note"] = self.note
        d.update(self.extra)
        return d

    def __str__(self) -> str:
        parts = [f"{self.a} vs {self.b}: {self.verdict_text}"]
        if self.verdict is not Verdict.BITWISE_EQUAL:
            if self.mismatched is not None and self.numel:
                parts.append(f"{self.mismatched}/{self.numel} elements differ")
            if self.max_abs is not None:
                parts.append(f"max abs {self.max_abs:.3g}")
            if self.max_rel is not None:
                parts.append(f"max rel {self.max_rel:.3g}")
            if self.ulp is not None:
                parts.append(f"{self.ulp} ulp")
            if self.argmax_agree is not None:
                parts.append(f"argmax agrees on {100 * self.argmax_agree:.1f}% of rows")
            if self.topk_overlap is not None:
                parts.append(f"top-5 overlap {self.topk_overlap:.2f}")
        if self.margin is not None:
            parts.append(f"top-2 margin {self.margin:.3g}")
        if self.note:
            parts.append(self.note)
        return ", ".join(parts)


def top2_margin(logits: torch.Tensor) -> float | None:
    """Smallest top-1 minus top-2 logit over all rows (None for non-logit-like tensors)."""
    if not logits.is_floating_point() or logits.dim() < 1 or logits.shape[-1] < 2 or logits.numel() == 0:
        return None
    top = logits.detach().float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Largest distance in units in the last place between matching elements (floats only)."""
    it = _INT_OF.get(a.dtype)
    if it is None or a.dtype != b.dtype or a.shape != b.shape or a.numel() == 0:
        return None
    ia = a.contiguous().view(it).to(torch.int64)
    ib = b.contiguous().view(it).to(torch.int64)
    bits = torch.finfo(a.dtype).bits
    sign = 1 << (bits - 1)
    # Map the sign-magnitude float order onto the integers so that neighbours differ by one.
    ia = torch.where(ia < 0, -(ia + sign) if bits < 64 else -(ia & (sign - 1)), ia)
    ib = torch.where(ib < 0, -(ib + sign) if bits < 64 else -(ib & (sign - 1)), ib)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(finite.any()):
        return None
    return int((ia - ib).abs()[finite].max())


def compare_tensors(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    name_a: str = "a",
    name_b: str = "b",
    rtol: float | None = None,
    atol: float | None = None,
    k: int = 5,
) -> Comparison:
    """Compare two tensors bit for bit, then numerically (on the CPU, in float64)."""
    a = a.detach().cpu()
    b = b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return Comparison(name_a, name_b, Verdict.DIFFERENT, note=f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    numel = a.numel()
    if numel == 0:
        return Comparison(name_a, name_b, Verdict.BITWISE_EQUAL, numel=0)
    raw_a = a.contiguous().reshape(-1).view(torch.uint8)
    raw_b = b.contiguous().reshape(-1).view(torch.uint8)
    margin = top2_margin(a)
    if torch.equal(raw_a, raw_b):
        return Comparison(name_a, name_b, Verdict.BITWISE_EQUAL, max_abs=0.0, max_rel=0.0, ulp=0, argmax_agree=1.0 if margin is not None else None, topk_overlap=1.0 if margin is not None else None, margin=margin, mismatched=0, numel=numel)
    if a.is_floating_point() or a.is_complex():
        fa, fb = a.double(), b.double()
        diff = (fa - fb).abs()
        finite = torch.isfinite(diff)
        max_abs = float(diff[finite].max()) if bool(finite.any()) else math.inf
        denom = torch.maximum(fa.abs(), fb.abs()).clamp_min(torch.finfo(a.dtype).tiny)
        rel = diff / denom
        max_rel = float(rel[finite].max()) if bool(finite.any()) else math.inf
        elem_diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        mismatched = int(elem_diff.sum())
        if rtol is None:
            rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(a.dtype, 1e-5)
        if atol is None:
            atol = rtol * 1e-3
        within = bool(torch.allclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True))
        argmax = topk = None
        if margin is not None:
            am = fa.argmax(-1) == fb.argmax(-1)
            argmax = float(am.float().mean())
            kk = min(k, a.shape[-1])
            ta = fa.topk(kk, dim=-1).indices.reshape(-1, kk)
            tb = fb.topk(kk, dim=-1).indices.reshape(-1, kk)
            overlap = (ta.unsqueeze(-1) == tb.unsqueeze(-2)).any(-1).float().sum(-1) / kk
            topk = float(overlap.mean())
        return Comparison(
            name_a,
            name_b,
            Verdict.WITHIN_TOLERANCE if within else Verdict.DIFFERENT,
            note=_non_finite_note(fa, fb, name_a, name_b),
            max_abs=max_abs,
            max_rel=max_rel,
            ulp=ulp_distance(a, b),
            argmax_agree=argmax,
            topk_overlap=topk,
            margin=margin,
            mismatched=mismatched,
            numel=numel,
            rtol=rtol,
            atol=atol,
        )
    mismatched = int((a != b).sum())
    return Comparison(name_a, name_b, Verdict.DIFFERENT, mismatched=mismatched, numel=numel,
                      max_abs=float((a.long() - b.long()).abs().max()) if not a.dtype.is_floating_point else None)


def _non_finite_note(fa: torch.Tensor, fb: torch.Tensor, name_a: str, name_b: str) -> str:
    """Elements NaN or infinite on one side and not (or otherwise) on the other: the maximum
    differences above are over the finite ones only, so a NaN against a number would otherwise
    read as "max abs 0"."""
    odd = (torch.isnan(fa) != torch.isnan(fb)) | (torch.isinf(fa) | torch.isinf(fb)) & (fa != fb) & ~(torch.isnan(fa) | torch.isnan(fb))
    n = int(odd.sum())
    if not n:
        return ""

    def count(t: torch.Tensor) -> str:
        nan, inf = int(torch.isnan(t[odd]).sum()), int(torch.isinf(t[odd]).sum())
        return ", ".join([f"{nan} NaN"] * bool(nan) + [f"{inf} inf"] * bool(inf)) or "finite"

    return (f"{n} element(s) NaN or inf on one side only ({name_a}: {count(fa)}; {name_b}: {count(fb)}); the maximum "
            f"differences are over the finite elements")


def compare_digests(a: int, b: int, *, name_a: str = "a", name_b: str = "b") -> Comparison:
    """All that two digests can say: equal bits or different bits."""
    verdict = Verdict.BITWISE_EQUAL if a == b else Verdict.DIFFERENT
    note = "" if a == b else f"digest {format_digest(a)} vs {format_digest(b)} (recorded as digests only)"
    return Comparison(name_a, name_b, verdict, note=note)


def tensor_digest(t: torch.Tensor) -> int:
    return digest(t)
