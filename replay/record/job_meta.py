"""A job's meta: what salvage needs to turn the job's record in the ring into its frame (as the
drain would), and its JSON text, written into the ring by ``Staging.seal_job``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from replay.record.writer import Job

if TYPE_CHECKING:
    from replay.record.staging import RingJob

__all__ = ["job_meta", "MetaText", "RING_ATS"]

# A job's meta, encoded once per job right after the step: one encoder for all (``json.dumps``
# with options builds one a call), and no check for cycles (a meta is a tree of built-ins).
_META_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=True, check_circular=False)
# The key of ``job_meta``'s ring offsets (never written: ``MetaText.encode`` puts them in the rows).
RING_ATS = "_ring_ats"
_ROW_AT = 5  # the ring offset's place in a row of ``g``
_MAX_TEMPLATES = 16


class MetaText:
    """Jobs' metas as JSON text. Encoding a step's meta cost ~30 µs on the program's thread (its
    caches cold from the model's forward), most of it the tensor rows, which from step to step
    differ only in where their bytes lie in the ring: their text is made once per set of rows
    (a template with the offsets left out) and filled in with ``%``."""

    def __init__(self) -> None:
        self._templates: list[tuple[dict[str, Any], str | None]] = []  # rows (offsets 0), template (or _PENDING)

    def encode(self, meta: dict[str, Any]) -> bytes:
        ats = meta.pop(RING_ATS, None)
        groups = meta.get("g")
        if not groups or ats is None:
            return _META_JSON.encode(meta).encode()
        template = self._template(groups, ats)
        if template is None:
            return _META_JSON.encode({**meta, "g": _with_ats(groups, ats)}).encode()
        rest = _META_JSON.encode({k: v for k, v in meta.items() if k != "g"})
        return ('{"g":' + template % tuple(ats) + ("," + rest[1:] if len(rest) > 2 else "}")).encode()

    def _template(self, groups: dict[str, Any], ats: list[int]) -> str | None:
        """The rows' template; made the second time they are seen (rows seen once, a job outside
        the steps, are encoded as they are: no template is made for them)."""
        for i, (rows, template) in enumerate(self._templates):
            if rows == groups:
                if template is _PENDING:
                    template = _make_template(groups, ats)
                    self._templates[i] = (rows, template)
                return template
        if len(self._templates) >= _MAX_TEMPLATES:
            self._templates.pop(0)
        self._templates.append((groups, _PENDING))
        return None


_PENDING = "rows seen once"
# A stand-in offset, replaced by ``%d`` in a template's text.
_AT_MARK = 7213901478231045311


def _with_ats(groups: dict[str, Any], ats: list[int]) -> dict[str, Any]:
    it = iter(ats)
    return {name: [[*r[:_ROW_AT], next(it), *r[_ROW_AT + 1:]] for r in rows] for name, rows in groups.items()}


def _make_template(groups: dict[str, Any], ats: list[int]) -> str | None:
    """The rows' text with each offset as ``%d`` (and any ``%`` of a name doubled); None when the
    filled template would not be the rows' own text (a name holding the stand-in's digits)."""
    marked = _META_JSON.encode(_with_ats(groups, [_AT_MARK] * len(ats)))
    template = marked.replace("%", "%%").replace(str(_AT_MARK), "%d")
    try:
        if template % tuple(ats) == _META_JSON.encode(_with_ats(groups, ats)):
            return template
    except (TypeError, ValueError):
        pass
    return None


def job_meta(job: Job, rjob: RingJob) -> dict[str, Any]:
    """What salvage needs to turn a job's ring record into its frame, as the drain would.

    Each row of ``g`` holds 0 where its bytes lie in the ring: those offsets, in row order, are
    under ``RING_ATS``, and ``MetaText.encode`` puts them back (a step's rows are otherwise the same
    from step to step: their text is made once)."""
    groups = {}
    ats: list[int] = []
    external = rjob.external
    for name, entries in job.groups.items():
        rows = []
        for e in entries:
            if e.packed is not None:
                n = e.packed[2]
            elif e.npv is not None:
                n = e.npv.nbytes
            elif e.host is not None:
                n = e.host.numel() * e.host.element_size()
            else:
                n = 0
            if e.ring_at < 0 and e.digest is None and (e.digest_slot < 0 or e.store):
                external = True
            dig = f"{e.digest:016x}" if e.digest is not None else None
            rows.append([e.name, int(e.kind), e.dtype, list(e.shape), bool(e.store), 0, n, dig, e.digest_slot])
            ats.append(e.ring_at)
        groups[name] = rows
    meta: dict[str, Any] = {"b": job.body, "g": groups, "f": job.fin, RING_ATS: ats}
    if job.digests_at >= 0 and job.digests_host is not None:
        meta["d"] = [job.digests_at, int(job.digests_host.numel())]
    if job.margin_at >= 0:
        meta["m"] = job.margin_at
    if external:
        meta["x"] = 1
    return meta
