"""Delta debugging (Zeller and Hildebrandt's ddmin) over a set of changes.

``ddmin(changes, flips)`` returns a 1-minimal subset of ``changes`` for which ``flips`` is true
(removing any single change from it makes ``flips`` false), given that ``flips`` holds for the
full set and not for the empty one. ``flips`` is the expensive oracle (here: a probe process);
the search asks it about as few subsets as it can and never twice about the same one, so an
oracle backed by a cache on disk makes an interrupted search resume where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["ddmin", "split"]

T = TypeVar("T")


def split(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` cut into ``n`` contiguous, near-equal, non-empty parts."""
    n = max(1, min(n, len(items)))
    out, start = [], 0
    for i in range(n):
        stop = start + (len(items) - start) // (n - i)
        out.append(list(items[start:stop]))
        start = stop
    return out


def ddmin(changes: Sequence[T], flips: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal subset of ``changes`` whose application flips the outcome."""
    current = list(changes)
    n = 2
    asked: dict[tuple[int, ...], bool] = {}
    index = {id(c): i for i, c in enumerate(changes)}

    def test(subset: list[T]) -> bool:
        key = tuple(sorted(index[id(c)] for c in subset))
        if key not in asked:
            asked[key] = flips(subset)
        return asked[key]

    while len(current) >= 2:
        parts = split(current, n)
        reduced = False
        for part in parts:  # one part alone may be enough
            if test(part):
                current, n, reduced = part, 2, True
                break
        if not reduced and n > 2:  # else the complements are the parts themselves
            for part in parts:
                complement = [c for c in current if c not in part]
                if test(complement):
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current
