"""Progress bars for long work, drawn on stderr only when stderr is a terminal.

One helper, usable two ways::

    from replay.cli.progress import progress

    for rank in progress(ranks, label="sealing"):          # wraps any iterable
        seal(rank)

    with progress(length=n_probes, label="bisecting") as bar:  # or counts by hand
        while ...:
            probe(); bar.update(1)

When stderr is not a terminal (a pipe, a file, CI, a test), nothing at all is written, so
``--json`` output and logs stay clean. ``REPLAY_PROGRESS=0`` turns bars off on a terminal too;
``REPLAY_PROGRESS=1`` forces them on (for trying them out). The bar redraws at most 10 times a
second and erases itself when done, so the lines printed after it start on a clean line.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Generic, TextIO, TypeVar

__all__ = ["Progress", "progress", "progress_enabled"]

T = TypeVar("T")

_MIN_INTERVAL_S = 0.1


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether bars are drawn on ``stream`` (default: stderr)."""
    flag = os.environ.get("REPLAY_PROGRESS", "").strip().lower()
    if flag in ("0", "no", "off", "false"):
        return False
    if flag in ("1", "yes", "on", "true"):
        return True
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


class Progress(Generic[T]):
    """A bar over ``iterable`` (or ``length`` units counted with ``update``)."""

    def __init__(
        self, iterable: Iterable[T] | None = None, *, label: str = "", length: int | None = None, stream: TextIO | None = None
    ) -> None:
        self._iterable = iterable
        if length is None and iterable is not None:
            try:
                length = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                length = None
        self.length = length
        self.label = label
        self.done = 0
        self._stream = stream
        self._on = progress_enabled(stream)
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self._on:
            return
        now = time.monotonic()
        if not force and now - self._last < _MIN_INTERVAL_S:
            return
        self._last = now
        elapsed = now - self._t0
        width = 28
        if self.length:
            frac = min(1.0, self.done / self.length)
            fill = int(frac * width)
            bar = "#" * fill + "-" * (width - fill)
            eta = f" eta {_dur(elapsed / frac - elapsed)}" if 0 < frac < 1 and elapsed > 1 else ""
            text = f"{self.label} [{bar}] {self.done}/{self.length} {_dur(elapsed)}{eta}"
        else:
            text = f"{self.label} {self.done} {_dur(elapsed)}"
        try:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
            self._drawn = True
        except (OSError, ValueError):
            self._on = False

    def close(self) -> None:
        """Erase the bar (a finished bar leaves no line behind)."""
        if self._on and self._drawn:
            try:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self._on = False

    def __iter__(self) -> Iterator[T]:
        if self._iterable is None:
            raise TypeError("progress(length=...) counts with update(); give an iterable to iterate")
        self._draw(force=True)
        try:
            for item in self._iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Progress[T]:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    iterable: Iterable[T] | None = None, *, label: str = "", length: int | None = None, stream: TextIO | None = None
) -> Progress[T]:
    """A progress bar over ``iterable``, or a counter of ``length`` units used as a context manager.

    Draws on stderr (or ``stream``) only when it is a terminal; otherwise silent.
    """
    return Progress(iterable, label=label, length=length, stream=stream)


def _dur(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    m, s = divmod(int(s), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"
