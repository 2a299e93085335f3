"""Several models in one part (draft and target, MTP head and trunk): which stream a re-run rebuilds.

The recorder names each model of a part a stream (``attrs["target"]["streams"]``, the first one
also ``attrs["target"]["stream"]``) and tags every step recorded once a second stream exists with
``"__stream__": NAME`` in its JSON arguments; untagged steps belong to the first stream. A
keyframe holds every stream's state, the first stream's under its own names and the others'
under ``NAME/``. A re-run rebuilds one stream: it restores that stream's state only and feeds it
its own steps only (each model's steps depend on its own state and their recorded inputs).
"""

from __future__ import annotations

import json


import torch

from replay.errors import OutOfRange
from replay.format.reader import RankFile
from replay.numerics import STREAM_ARG

__all__ = ["streams_of", "first_stream", "stream_of", "stream_state", "check_stream", "target_info"]


def streams_of(rf: RankFile) -> list[str]:
    t = rf.attrs.get("target")
    if not isinstance(t, dict):
        return []
    names = list(t["streams"]) if isinstance(t.get("streams"), dict) else []
    first = t.get("stream")
    if isinstance(first, str) and first not in names:
        names.insert(0, first)
    return [str(n) for n in names]


def first_stream(rf: RankFile) -> str | None:
    t = rf.attrs.get("target")
    first = t.get("stream") if isinstance(t, dict) else None
    return first if isinstance(first, str) else None


def stream_of(rf: RankFile, step: int) -> str | None:
    """The stream step ``step`` belongs to (None: a part of one model, or an older recording)."""
    if len(streams_of(rf)) < 2:
        return None
    sid = int(rf.step(step).row["args"])
    try:
        args = json.loads(rf.tables.string(sid)) if sid >= 0 else {}
    except ValueError:
        args = {}
    name = args.get(STREAM_ARG) if isinstance(args, dict) else None
    return name if isinstance(name, str) else first_stream(rf)


def check_stream(rf: RankFile, step: int, stream: str | None) -> str | None:
    """The stream to rebuild for ``step``: ``stream`` if given (it must hold the step), else the
    one that holds it."""
    holder = stream_of(rf, step)
    if stream is None:
        return holder
    names = streams_of(rf)
    if stream not in names:
        raise OutOfRange(f"rank {rf.rank} has no stream {stream!r} (streams: {', '.join(names) or 'none'})")
    if holder is not None and holder != stream:
        raise OutOfRange(f"step {step} of rank {rf.rank} is a step of stream {holder!r}, not {stream!r}")
    return stream


def stream_state(rf: RankFile, state: dict[str, torch.Tensor], stream: str | None) -> dict[str, torch.Tensor]:
    """The part of a keyframe that is ``stream``'s state, under the stream's own names."""
    if stream is None or len(streams_of(rf)) < 2:
        return state
    if stream == first_stream(rf):
        return {k: v for k, v in state.items() if not any(k.startswith(f"{n}/") for n in streams_of(rf))}
    prefix = f"{stream}/"
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}




def target_info(rf: RankFile, stream: str | None) -> dict:
    """The recorded target info of ``stream`` (the part's, with the stream's own entries)."""
    t = rf.attrs.get("target")
    if not isinstance(t, dict):
        return {}
    streams = t.get("streams") if isinstance(t.get("streams"), dict) else {}
    if stream is not None and isinstance(streams.get(stream), dict):
        return {**t, **streams[stream], "stream": stream}
    return dict(t)
