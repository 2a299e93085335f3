"""Plain terminal rendering: aligned tables, and colour only when writing to a terminal.

Colour follows the usual conventions: none when the stream is not a terminal, none when
``NO_COLOR`` is set (https://no-color.org), always when ``FORCE_COLOR`` is set.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

__all__ = ["VERDICT_COLOURS", "colour_enabled", "fmt_margin", "fmt_verdict", "style", "table"]

VERDICT_COLOURS = {"bitwise equal": "green", "within tolerance": "yellow", "different": "red"}


def colour_enabled(err: bool = False) -> bool:
    """Whether text written to stdout (or stderr, ``err=True``) may carry colour."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    stream = sys.stderr if err else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def style(text: str, *, err: bool = False, **kw: Any) -> str:
    """``click.style`` when the stream (stdout, or stderr with ``err=True``) takes colour."""
    return click.style(text, **kw) if colour_enabled(err) else text


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(click.unstyle(r[i])) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        line = "  ".join(c + " " * (w - len(click.unstyle(c))) for c, w in zip(r, widths)).rstrip()
        lines.append(indent + (style(line, bold=True) if j == 0 else line))
    return "\n".join(lines)


def fmt_margin(m: float | None) -> str:
    return "-" if m is None else f"{m:.3g}"


def fmt_verdict(verdict: str) -> str:
    """A compare verdict, coloured by how bad it is (green equal, yellow close, red different)."""
    colour = VERDICT_COLOURS.get(verdict)
    return style(verdict, fg=colour, bold=verdict == "different") if colour else verdict
