"""A rank-aware logger: library code logs through it, never ``print``."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger"]

_configured = False


def _rank_prefix() -> str:
    # Read the launcher's variables rather than torch.distributed: logging must work before
    # (and without) a process group, and must never initialise one.
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank is not None else ""


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"replay: {_rank_prefix()}{record.getMessage()}"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (test capture and redirection swap it)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def get_logger(name: str = "replay") -> logging.Logger:
    global _configured
    logger = logging.getLogger("replay")
    if not _configured:
        handler = _StderrHandler()
        handler.setFormatter(_RankFormatter())
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(os.environ.get("REPLAY_LOG_LEVEL", "WARNING").upper())
        _configured = True
    return logger if name == "replay" else logger.getChild(name.removeprefix("replay."))
