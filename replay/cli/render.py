"""Plain terminal rendering: aligned tables, and colour only when writing to a terminal."""

from __future__ import annotations

import sys
from typing import Any, Sequence

import click

__all__ = ["table", "style", "fmt_margin"]


def style(text: str, **kw: Any) -> str:
    return click.style(text, **kw) if sys.stdout.isatty() else text


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
