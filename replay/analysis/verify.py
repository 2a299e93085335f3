"""``replay verify``: is a recording intact, and if not, exactly what is damaged or lost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.digest import digest
from replay.errors import ReplayError
from replay.format.reader import Part, RankFile, Recording
from replay.states import CheckState

__all__ = ["RankCheck", "verify_recording"]


@dataclass(slots=True)
class RankCheck:
    part: str
    rank: int
    steps: int = 0
    last_step: int | None = None  # the last step kept, None when there is none
    tensors_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tail_problems: int = 0  # how many of ``problems`` are only a lost end (a kill, a size limit)

    @property
    def intact(self) -> bool:
        return not self.problems

    @property
    def state(self) -> CheckState:
        """``intact``; ``incomplete``: what is there is whole, but the end of the run is missing
        (killed, crashed, recording stopped); ``damaged``: something recorded cannot be trusted."""
        if not self.problems:
            return CheckState.INTACT
        return CheckState.INCOMPLETE if self.tail_problems == len(self.problems) else CheckState.DAMAGED

    def lost_tail(self, message: str) -> None:
        self.problems.append(message)
        self.tail_problems += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "rank": self.rank,
            "steps": self.steps,
            "last_step": self.last_step,
            "tensors_checked": self.tensors_checked,
            "intact": self.intact,
            "state": self.state,
            "problems": self.problems,
            "notes": self.notes,
        }


def _check_rank(part: Part, rf: RankFile, *, payload: bool) -> RankCheck:
    c = RankCheck(part=part.name, rank=rf.rank)
    rf.check_payload_size = not payload  # re-digesting every tensor names the ones a short payload cuts off
    try:
        t = rf.full()
    except ReplayError as e:
        c.problems.append(str(e).removesuffix("; `replay verify` says more"))  # this is verify
        return c
    steps = t.steps["step"]
    c.steps = int(steps.size)
    c.last_step = int(steps[-1]) if steps.size else None
    if rf.live:
        c.notes.append("still recording (its process holds the journal)")
    elif not rf.sealed:
        c.notes.append("not sealed yet (a journal left by a process that ended without closing)")
    _check_end(c, t.attrs, live=rf.live)
    if steps.size and not np.array_equal(steps, np.arange(steps.size)):
        gaps = np.flatnonzero(np.diff(steps) != 1)
        c.problems.append(f"steps are not contiguous (first gap after step {int(steps[gaps[0]]) if gaps.size else '?'})")
    if payload:
        _check_payload(c, rf, t)
    return c


def _check_end(c: RankCheck, attrs: dict[str, Any], *, live: bool) -> None:
    """How the rank's recording ended: a frame cut short, a stop, or no end marker (a kill)."""
    last = c.last_step
    kept = f"steps 0..{last} are kept" if last is not None else "no step was recorded"
    problem = attrs.get("journal_problem")
    if problem:
        c.lost_tail(
            f"journal ended inside a frame ({problem}): the last {attrs.get('lost_bytes', '?')} bytes, "
            "an unfinished record, were dropped"
        )
    if live:
        return
    stopped = attrs.get("stopped")
    if stopped:
        c.lost_tail(
            f"recording stopped {f'after step {last}' if last is not None else 'before its first step'} "
            f"({stopped}): {kept}; the steps the program ran after that were not recorded"
        )
    elif not attrs.get("complete"):
        if attrs.get("no_header"):
            c.lost_tail("killed before it wrote its header: nothing was recorded")
        else:
            c.lost_tail(
                "ended without its end marker (the process was killed, crashed, or left through os._exit, as a "
                "forked child does) "
                + (f"after step {last}: {kept}; anything it did after that was not recorded" if last is not None
                   else "before its first step: no step was recorded")
            )


def _check_payload(c: RankCheck, rf: RankFile, t: Any) -> None:
    """Re-digest every stored tensor (deduplicated bytes once); stop after 20 problems."""
    stored = t.tensors[t.tensors["offset"] >= 0]
    seen: set[tuple[int, int]] = set()
    for row in stored:
        key = (int(row["offset"]), int(row["nbytes"]))
        if key in seen:  # deduplicated bytes: checked once
            continue
        seen.add(key)
        try:
            tensor = rf.read_tensor(row, check_digest=False)  # checked below, to list every damaged tensor
        except ReplayError as e:
            c.problems.append(str(e))
            break
        c.tensors_checked += 1
        if digest(tensor) != int(row["digest"]):
            name = t.string(int(row["name"]))
            c.problems.append(f"tensor {name!r} of step {int(row['step'])}: payload bytes do not match their digest")
            if len(c.problems) > 20:
                break


def verify_recording(rec: Recording, *, payload: bool = True) -> list[RankCheck]:
    """Check every rank file of every part; ``payload`` re-digests every stored tensor."""
    checks: list[RankCheck] = []
    for part in rec.values():
        for rf in part.values():
            checks.append(_check_rank(part, rf, payload=payload))
        declared = part.world_size
        for missing in sorted(set(range(declared)) - set(part)):
            c = RankCheck(part=part.name, rank=missing)
            c.lost_tail(
                f"no file for rank {missing} of {declared}: nothing was recorded for it (it ended before it "
                "started recording, or its file was removed)"
            )
            checks.append(c)
    return checks
