"""The first divergence across ranks, found from the per-step field digests alone.

Only the summary tables are read (never tensor payloads), one array per rank, and the search is
vectorised: the cost is a sort of all (step, field) keys, so 8 ranks x 100,000 steps take well
under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from replay.analysis.collective_inputs import INPUT_SUFFIX, first_input_divergence
from replay.analysis.vote import majority_text, vote
from replay.errors import RecordingDamaged
from replay.format.reader import Part, RankFile

__all__ = ["Divergence", "STATUS_FIELD", "first_divergence", "order_in_step", "rank_only_fields", "vote"]

_ABSENT = np.uint64(0)


@dataclass(slots=True)
class Divergence:
    """Where ranks first disagree: the step, the field, and the odd ranks out."""

    step: int
    field: str
    ranks: list[int]  # the odd ones out
    majority: list[int]  # the ranks in the largest group
    digests: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "field": self.field,
            "ranks": self.ranks,
            "majority": self.majority,
            # Whether the largest group is more than half the ranks compared (else the ranks
            # named odd are the ones outside the lowest rank's group, by rule, not by vote).
            "majority_strict": 2 * len(self.majority) > len(self.majority) + len(self.ranks),
            "digests": {str(r): f"{d:016x}" for r, d in sorted(self.digests.items())},
            "what": self.what(),
            "majority_text": self.majority_text(),
        }

    def what(self) -> str:
        """What differs, in words: "output.logits differs on rank(s) 1 (majority: 0, 2, 3)", or
        for a step some ranks raised in, "rank(s) 1 raised in the step, rank(s) 0 completed it"."""
        if self.field == STATUS_FIELD:
            raised = sorted(r for r, v in self.digests.items() if v)
            done = sorted(r for r, v in self.digests.items() if not v)
            return (f"rank(s) {', '.join(map(str, raised))} raised in the step, rank(s) {', '.join(map(str, done))} "
                    "completed it")
        if self.field.endswith(INPUT_SUFFIX):
            return (f"the input of {self.field[:-len(INPUT_SUFFIX)]} differs on rank(s) {', '.join(map(str, self.ranks))} "
                    f"({self.majority_text()}), where it agrees at most steps or agreed at every step before; every rank "
                    "received the same output, "
                    "which hides the difference from the fields after it")
        return f"{self.field} differs on rank(s) {', '.join(map(str, self.ranks))} ({self.majority_text()})"

    def majority_text(self) -> str:
        """What the odd ranks are odd against ("majority: 0, 1, 3", or that there is no majority)."""
        groups = len(set(self.digests.values())) + (1 if len(self.digests) < len(self.ranks) + len(self.majority) else 0)
        return majority_text(self.ranks, self.majority, groups)

    def __str__(self) -> str:
        odd = ", ".join(map(str, self.ranks))
        return f"step {self.step}: {self.field} differs on rank{'s' if len(self.ranks) > 1 else ''} {odd}"


def _field_ids(rf: RankFile, names: dict[str, int], prefix: str | None,
               steps_kept: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, global field id, digest) of a rank's field rows, in program order.

    Field names are per-file string ids; they are mapped to ids shared by all ranks through a
    lookup table over the few distinct names, so no per-row Python work is done.
    """
    t = rf.tables
    f = t.fields
    lut = np.full(len(t.strings) + 1, -1, dtype=np.int64)
    for i in np.unique(f["field"]):
        name = t.string(int(i))
        if prefix is None or name.startswith(prefix):
            lut[int(i)] = names.setdefault(name, len(names))
    gid = lut[f["field"]]
    steps, digests = f["step"], f["digest"]
    if prefix is not None or steps_kept is not None:
        keep = gid >= 0
        if steps_kept is not None:
            keep &= np.isin(steps, steps_kept)
        gid, steps, digests = gid[keep], steps[keep], digests[keep]
    return steps, gid, digests


def field_names(part: Part) -> set[str]:
    """The names of the fields any rank recorded (one scan of each rank's field table)."""
    names: set[str] = set()
    for rf in part.values():
        t = rf.tables
        names.update(t.string(int(i)) for i in np.unique(t.fields["field"]))
    return names


def has_fields(names: set[str], prefix: str) -> bool:
    """Whether a field of ``names`` (``field_names``) starts with ``prefix`` (``"tokens."``):
    without one, no divergence of such fields can be claimed or denied."""
    return any(n.startswith(prefix) for n in names)


# The verdict when the ranks agree on everything recorded, and that is only what went into the steps.
# What to do when no step output was recorded: --output-name only names a returned tuple's tensors.
OUTPUT_REMEDY = ("record a callable inside the step with --probe (what it returns is compared), or name as the step a "
                 "callable that returns its logits; --output-name only names the tensors of a returned tuple, and a "
                 "step that returns no tensor (None, a Python list) has none to name")
NO_OUTPUT_FIELDS = f"the steps recorded no output or token field, only what went into them (which agrees); {OUTPUT_REMEDY}"


def computed_fields(names: set[str]) -> bool:
    """Whether any rank recorded a field the steps computed (an output, a token, a probe's):
    inputs, arguments and collectives alone cannot show that the ranks computed the same."""
    return has_fields(names, "output.") or has_fields(names, "tokens.")


def first_divergence(
    part: Part, *, prefix: str | None = None, ranks: Iterable[int] | None = None, steps: np.ndarray | None = None
) -> Divergence | None:
    """The first (step, field) at which the ranks' digests disagree.

    ``prefix`` limits the fields compared (``"tokens."`` for the first token divergence),
    ``steps`` the steps (those of one stream, say). A step a rank never reached is not a
    disagreement: it is left out for that rank.
    """
    chosen = sorted(ranks) if ranks is not None else list(part)
    if len(chosen) < 2:
        return None
    found = _first_field_divergence(part, chosen, prefix, steps)
    if prefix is not None:
        return found
    hidden = _first_hidden_divergence(part, chosen, steps)
    # A collective's input is named where no field shows the difference (at an earlier step, or
    # with none at all): at a step where a field differs too, that field is named (the collective
    # may be one the loop made after the step's call returned, kept under the step).
    if hidden is not None and (found is None or hidden.step < found.step):
        found = hidden
    raised = _first_status_divergence(part, chosen, steps)
    # A step one rank raised in and another completed is where their runs broke apart; a field
    # that differs first at the same step (an input) is its likelier cause and goes first.
    if raised is not None and (found is None or raised.step < found.step or (
            raised.step == found.step and not found.field.startswith(_CAUSES))):
        return raised
    return found


def _first_hidden_divergence(part: Part, chosen: list[int], steps: np.ndarray | None) -> Divergence | None:
    """A collective's input that differs across ranks where it agrees at most steps (the
    collective hands every rank the same output: no field after it differs)."""
    try:
        hit = first_input_divergence(part, chosen, steps)
    except RecordingDamaged:
        return None  # the collectives of a damaged rank: not compared (reading it says why)
    return _verdict(*hit) if hit is not None else None


# Fields that go into a step: differing at the step a rank raised in, they come first.
_CAUSES = ("input.", "collective.")
# The field a step's status is compared as (``Divergence.what`` says it in words).
STATUS_FIELD = "step status (raised)"


def _first_status_divergence(part: Part, chosen: list[int], steps: np.ndarray | None) -> Divergence | None:
    """The first step recorded by two ranks or more that some raised in and others completed
    (a rank's field rows stop at its raise, so comparing fields alone calls them equal)."""
    tables = {r: part[r].tables.steps for r in chosen}
    if steps is not None:
        tables = {r: t[np.isin(t["step"], steps)] for r, t in tables.items()}
    raised = np.unique(np.concatenate([t["step"][t["status"] != 0] for t in tables.values()] or [np.zeros(0, np.int64)]))
    for step in raised:
        values = {}
        for r, t in tables.items():
            at = np.flatnonzero(t["step"] == step)
            if at.size:
                values[r] = int(t["status"][at[0]] != 0)
        if len(values) > 1 and len(set(values.values())) > 1:
            return _verdict(int(step), STATUS_FIELD, values)
    return None


def _role_ids(rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> set[int]:
    """Fields that some ranks record from their first step on and the others never do: the
    ranks run different code by design (pipeline stages: one returns hidden states, the next
    logits), not the same code that came apart. A field one rank adds later, or one a rank
    lacks at some steps only, is not one of them: it is compared (its absence differs)."""
    if any(rows[r][0].size == 0 for r in rows):
        return set()
    held = {r: set(np.unique(rows[r][1]).tolist()) for r in rows}
    everyone = set.intersection(*held.values())
    role = set()
    for f in set.union(*held.values()) - everyone:
        holders = [r for r in rows if f in held[r]]
        if all(f in rows[r][1][rows[r][0] == rows[r][0][0]] for r in holders):
            role.add(f)
    return role


def rank_only_fields(part: Part, ranks: Iterable[int] | None = None) -> dict[str, list[int]]:
    """``{field: the ranks that record it}`` for the fields ``_role_ids`` leaves out of the
    comparison across ranks (they are not compared, and a verdict says so)."""
    chosen = sorted(ranks) if ranks is not None else list(part)
    names: dict[str, int] = {}
    rows = {r: _field_ids(part[r], names, None) for r in chosen}
    ids = {i: n for n, i in names.items()}
    return {ids[f]: [r for r in chosen if (rows[r][1] == f).any()] for f in sorted(_role_ids(rows), key=lambda f: ids[f])}


def _first_field_divergence(part: Part, chosen: list[int], prefix: str | None,
                            steps: np.ndarray | None) -> Divergence | None:
    names: dict[str, int] = {}
    rows = {r: _field_ids(part[r], names, prefix, steps) for r in chosen}
    ids = {i: n for n, i in names.items()}
    role = _role_ids(rows)
    if role:
        drop = np.array(sorted(role), dtype=np.int64)
        rows = {r: tuple(a[~np.isin(rows[r][1], drop)] for a in rows[r]) for r in chosen}  # type: ignore[misc]
    # Fast path: ranks in lockstep record the same fields in the same order, so their rows line
    # up one to one and a column-wise comparison finds the first difference in O(ranks x rows).
    n = min(len(rows[r][0]) for r in chosen)
    s0, g0, d0 = rows[chosen[0]]
    if all(np.array_equal(rows[r][0][:n], s0[:n]) and np.array_equal(rows[r][1][:n], g0[:n]) for r in chosen[1:]):
        differs = np.zeros(n, dtype=bool)
        for r in chosen[1:]:
            differs |= rows[r][2][:n] != d0[:n]
        if differs.any():
            i = int(np.argmax(differs))
            return _verdict(int(s0[i]), ids[int(g0[i])], {r: int(rows[r][2][i]) for r in chosen})
        longer = [r for r in chosen if len(rows[r][0]) > n]
        if len(longer) < 2:
            return None
        # Some ranks went on past the others' last step: compare those among themselves.
        last = int(s0[n - 1]) if n else -1
        return _general({r: tuple(a[rows[r][0] > last] for a in rows[r]) for r in longer}, part, ids)
    return _general(rows, part, ids)


def _verdict(step: int, field_name: str, values: dict[int, int]) -> Divergence:
    majority, odd = vote(values)
    return Divergence(step=step, field=field_name, ranks=odd, majority=majority,
                      digests={r: v for r, v in values.items() if v >= 0})


def _general(rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], part: Part, ids: dict[int, str]) -> Divergence | None:
    """Ranks whose field rows do not line up (an extra collective, a missing output): align the
    rows by (step, field) and compare; a field missing at a step a rank did record differs."""
    chosen = sorted(rows)
    keys = {r: (rows[r][0].astype(np.int64) << 20) | rows[r][1] for r in chosen}
    row_order = {r: order_in_step(rows[r][0]) for r in chosen}
    merged = np.sort(np.concatenate(list(keys.values())), kind="stable")
    if merged.size == 0:
        return None
    all_keys = merged[np.concatenate(([True], merged[1:] != merged[:-1]))]
    n = all_keys.size
    key_step = all_keys >> 20
    ref = np.zeros(n, dtype=np.uint64)
    have_ref = np.zeros(n, dtype=bool)
    differs = np.zeros(n, dtype=bool)
    order = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    aligned: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    raised = {r: _raised_steps(part[r]) for r in chosen}
    for r in chosen:
        idx = np.searchsorted(all_keys, keys[r])
        present = np.zeros(n, dtype=bool)
        present[idx] = True
        dig = np.zeros(n, dtype=np.uint64)
        dig[idx] = rows[r][2]
        order[idx] = np.minimum(order[idx], row_order[r])
        last_step = int(rows[r][0].max()) if rows[r][0].size else -1
        # A step the rank raised in has no outputs: their absence is the step's status (compared
        # as such), not a field that differs (no token was sampled there to differ).
        missing = ~present & (key_step <= last_step) & ~np.isin(key_step, raised[r])
        newref = present & ~have_ref
        ref[newref] = dig[newref]
        have_ref |= present
        differs |= (present & (dig != ref)) | missing
        aligned[r] = (present, dig)
    if not differs.any():
        return None
    cand = np.flatnonzero(differs)
    first = int(cand[np.lexsort((order[cand], key_step[cand]))[0]])
    values: dict[int, int] = {}
    for r in chosen:
        present, dig = aligned[r]
        last_step = int(rows[r][0].max()) if rows[r][0].size else -1
        if present[first]:
            values[r] = int(dig[first])
        elif key_step[first] <= last_step and key_step[first] not in raised[r]:
            values[r] = -1  # the field is missing on this rank
    return _verdict(int(key_step[first]), ids[int(all_keys[first] & ((1 << 20) - 1))], values)


def _raised_steps(rf: RankFile) -> np.ndarray:
    t = rf.tables.steps
    return t["step"][t["status"] != 0].astype(np.int64)


def order_in_step(steps: np.ndarray) -> np.ndarray:
    """Position of each row within its step (rows of a step are contiguous, in program order)."""
    if steps.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], steps[1:] != steps[:-1])))
    pos = np.arange(steps.size, dtype=np.int64)
    return pos - np.repeat(pos[starts], np.diff(np.append(starts, steps.size)))
