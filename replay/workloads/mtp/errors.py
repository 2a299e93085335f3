"""The error users meet when ranks drift."""

from __future__ import annotations

__all__ = ["RankDriftError"]


class RankDriftError(RuntimeError):
    """Ranks accepted different numbers of draft tokens at one decode step.

    ``ranks`` are the odd ones out: the ranks whose counts differ from the largest group that
    agrees (ties go to the group holding rank 0). ``counts`` holds every rank's counts.
    """

    def __init__(self, step: int, ranks: list[int], counts: list[list[int]]) -> None:
        self.step = step
        self.ranks = list(ranks)
        self.counts = [list(c) for c in counts]
        reference = next(r for r in range(len(counts)) if r not in self.ranks)
        odd = ", ".join(f"rank {r} accepted {self.counts[r]}" for r in self.ranks)
        super().__init__(
            f"rank drift at decode step {step}: {odd} but rank {reference} accepted {self.counts[reference]}; "
            "ranks computed different tokens (compare their tuner choices, or set broadcast_tokens)"
        )

    def __reduce__(self) -> tuple[type, tuple[int, list[int], list[list[int]]]]:
        return (type(self), (self.step, self.ranks, self.counts))

    @staticmethod
    def odd_ranks(counts: list[list[int]]) -> list[int]:
        """Ranks outside the largest group of equal counts (ties: the group with rank 0 wins)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(counts):
            groups.setdefault(tuple(c), []).append(rank)
        majority = max(groups.values(), key=lambda rs: (len(rs), 0 in rs))
        return [r for r in range(len(counts)) if r not in majority]
