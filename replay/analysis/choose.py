"""Which part, rank and step a command works on when the user leaves them out.

Every default is a reading of the recording (the only part, the first that diverged, the odd rank
at the first divergence) and is said out loud by the caller, so a default never surprises.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.analysis.divergence import Divergence, first_divergence
from replay.analysis.summary import choose_part
from replay.errors import UsageError
from replay.format.reader import Part

__all__ = ["Choice", "choose_part", "odd_rank", "pair_step", "rank_and_step", "recorded_device"]


@dataclass(kw_only=True, slots=True)
class Choice:
    """A rank and a step chosen for the user, and why (a sentence for the caller to show)."""

    rank: int
    step: int | None
    why: str | None = None
    divergence: Divergence | None = None


def odd_rank(part: Part) -> Choice:
    """The odd rank at the first divergence (the first rank when the ranks never disagree)."""
    d = first_divergence(part)
    r = d.ranks[0] if d is not None and d.ranks else next(iter(part))
    why = f"re-running rank {r}" + (f", the odd rank at the first divergence (step {d.step})" if d is not None else "")
    return Choice(rank=r, step=d.step if d is not None else None, why=why, divergence=d)


def pair_step(part: Part, a: int, b: int) -> Choice:
    """The first step where ranks ``a`` and ``b`` disagree (``rank`` is ``b``)."""
    if a == b:
        raise UsageError(f"give --step S (`replay bisect steps --against-rerun --rank {a}` finds one)")
    d = first_divergence(part, ranks=[a, b])
    if d is None:
        raise UsageError(f"ranks {a} and {b} never disagree: give --step S")
    return Choice(rank=b, step=d.step, divergence=d,
                  why=f"bisecting step {d.step}, where ranks {a} and {b} first disagree ({d.field})")


def rank_and_step(part: Part, rank: int | None, step: int | None) -> Choice:
    """``rank`` and ``step`` as given; what is left out comes from the first divergence (one
    rank: that rank)."""
    ranks = list(part)
    if rank is None and len(ranks) == 1:
        rank = ranks[0]
    if rank is not None and step is not None:
        return Choice(rank=rank, step=step)
    d = first_divergence(part)
    if d is None:
        raise UsageError("the ranks never disagree: give --rank R and --step S (and --criterion eager to compare "
                         "a CUDA graph re-run with an eager one, or --criterion reproduce to match the recording)")
    r = d.ranks[0] if rank is None else rank
    s = d.step if step is None else step
    return Choice(rank=r, step=s, divergence=d,
                  why=f"bisecting the settings of rank {r} at step {s}, the first divergence ({d.field})")


def recorded_device(part: Part) -> str | None:
    """The device the recorded target ran on (``cuda:1``, ``cpu``), if the recording says."""
    target = part[next(iter(part))].attrs.get("target") or {}
    dev = target.get("device") if isinstance(target, dict) else None
    return dev if isinstance(dev, str) else None
