"""The report's figures: matplotlib on the Agg backend, each returned as base64 PNG text.

matplotlib is imported on first use, so ``build_report`` and ``--json`` work without it.
Every figure is drawn from the binned arrays of a ``Report`` (at most ``MAX_BINS`` columns), so
its cost does not grow with the number of steps.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import numpy as np

from replay.errors import ReplayError
from replay.report.data import CELL_LABELS, Cell, Report, margin_histogram

__all__ = ["CELL_COLOURS", "accepted_plot", "agreement_map", "layer_curve", "margin_plot", "timeline_plot"]

# Every step-axis figure has the same geometry, so the step axes of the map, the curves and the
# timeline line up when the page is read from top to bottom; legends live in the right column.
WIDTH_IN = 11.4
LEFT_IN = 1.25
RIGHT_IN = 2.45
DPI = 110

CELL_COLOURS: dict[int, str] = {
    Cell.MISSING: "#ffffff",
    Cell.AGREE: "#e3e8ee",
    Cell.GRAPH: "#6baed6",
    Cell.INPUT: "#9e86c8",
    Cell.COLLECTIVE: "#e6b422",
    Cell.OUTPUT: "#f08a3c",
    Cell.TOKENS: "#d0312d",
    Cell.RAISED: "#111111",
}
_INK = "#1f2933"
_MUTED = "#7b8794"
_GRID = "#d9dee4"
_ODD = ["#d0312d", "#7b3fb5", "#1f77b4", "#2ca02c", "#e6851e", "#8c564b", "#e377c2", "#17becf"]
_KEY_COLOURS = [
    "#8ecae6", "#90be6d", "#f9c74f", "#b8a1e3", "#f4a3a8", "#7fd1c7", "#f6bd60", "#a3b1c6",
    "#cdb4db", "#b5e48c", "#ffd6a5", "#9bf6ff",
]
_EAGER = "#3d4451"
_UNKNOWN = "#c9ced6"

_plt: Any = None


def _pyplot() -> Any:
    global _plt
    if _plt is None:
        try:
            import matplotlib

            matplotlib.use("Agg", force=True)
            import matplotlib.pyplot as plt
        except ImportError:
            raise ReplayError("the HTML report needs matplotlib: pip install 'replay[report]' (or pip install matplotlib)") from None
        plt.rcParams.update(
            {
                "font.size": 10,
                "axes.edgecolor": _GRID,
                "axes.labelcolor": _INK,
                "axes.titlesize": 11,
                "axes.titleweight": "bold",
                "axes.titlelocation": "left",
                "xtick.color": _MUTED,
                "ytick.color": _MUTED,
                "axes.spines.top": False,
                "axes.spines.right": False,
                "svg.fonttype": "none",
            }
        )
        _plt = plt
    return _plt


def _figure(plot_in: float | list[float], *, top_in: float = 0.3, bottom_in: float = 0.55, gap_in: float = 0.15) -> tuple[Any, list[Any]]:
    """A figure whose axes (stacked, heights ``plot_in``) span the common step-axis column."""
    plt = _pyplot()
    heights = [plot_in] if isinstance(plot_in, (int, float)) else list(plot_in)
    h = top_in + bottom_in + sum(heights) + gap_in * (len(heights) - 1)
    fig = plt.figure(figsize=(WIDTH_IN, h))
    axes = []
    y = h - top_in
    for ph in heights:
        y -= ph
        axes.append(fig.add_axes((LEFT_IN / WIDTH_IN, y / h, (WIDTH_IN - LEFT_IN - RIGHT_IN) / WIDTH_IN, ph / h)))
        y -= gap_in
    return fig, axes


def _legend_right(ax: Any, handles: list[Any] | None = None, **kw: Any) -> None:
    if handles is None:
        ax.legend(loc="upper left", bbox_to_anchor=(1.015, 1.0), frameon=False, fontsize=9, borderaxespad=0, **kw)
    else:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.015, 1.0), frameon=False, fontsize=9, borderaxespad=0, **kw)


def _png(fig: Any, *, tight: bool = False) -> str:
    buf = io.BytesIO()
    kw: dict[str, Any] = {"bbox_inches": "tight", "pad_inches": 0.1} if tight else {}
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white", **kw)
    _pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _rank_ticks(ax: Any, ranks: list[int]) -> None:
    n = len(ranks)
    every = 1 if n <= 24 else math.ceil(n / 16)
    pos = list(range(0, n, every))
    ax.set_yticks(pos)
    ax.set_yticklabels([f"rank {ranks[i]}" for i in pos])
    ax.tick_params(axis="y", length=0)


def _rows_in(n: int) -> float:
    """Height of a ranks-as-rows plot: readable rows for a few ranks, bounded for many."""
    return min(6.0, max(1.1, n * (0.36 if n <= 8 else 0.22 if n <= 16 else 0.09)))


def _odd_ranks(rep: Report) -> list[int]:
    odd: list[int] = []
    for d in (rep.first_token_divergence, rep.first_divergence):
        for r in (d or {}).get("ranks", []):
            if r not in odd:
                odd.append(r)
    return odd


def _steps_axis(ax: Any, rep: Report, *, label: bool = True) -> None:
    ax.set_xlim(rep.first_step - 0.5, rep.last_step + 0.5)
    if label:
        ax.set_xlabel("step")


def _halo(width: float = 3.0) -> list[Any]:
    from matplotlib import patheffects

    return [patheffects.withStroke(linewidth=width, foreground="white")]


def agreement_map(rep: Report) -> str:
    """Ranks x steps: each cell coloured by the most severe way the rank differs from the majority."""
    _pyplot()  # matplotlib is there, or the error says what to install
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    r = len(rep.ranks)
    codes = sorted(CELL_COLOURS)
    cmap = ListedColormap([CELL_COLOURS[c] for c in codes])
    norm = BoundaryNorm([c - 0.5 for c in codes] + [codes[-1] + 0.5], cmap.N)
    fig, (ax,) = _figure(_rows_in(r), top_in=0.5)
    ax.imshow(rep.cells, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
              extent=(rep.first_step - 0.5, rep.last_step + 0.5, r - 0.5, -0.5))
    _rank_ticks(ax, rep.ranks)
    _steps_axis(ax, rep)
    for spine in ax.spines.values():
        spine.set_visible(False)
    marks = []
    d, t = rep.first_divergence, rep.first_token_divergence
    if d is not None:
        marks.append((d, "first divergence", _INK))
    if t is not None and (d is None or t["step"] != d["step"] or t["ranks"] != d["ranks"]):
        marks.append((t, "first token divergence", CELL_COLOURS[Cell.TOKENS]))
    mid = (rep.first_step + rep.last_step) / 2
    for k, (m, label, colour) in enumerate(marks):
        ax.axvline(m["step"], color=colour, lw=0.9, ls=(0, (3, 3)))
        for rank in m["ranks"][:8]:
            if rank in rep.ranks:
                ax.plot([m["step"]], [rep.ranks.index(rank)], marker="o", ms=12, mfc="none", mec=_INK, mew=1.8,
                        path_effects=_halo(4.5), clip_on=False, zorder=5)
        ax.annotate(
            f"{label}: step {m['step']}, {'rank' if len(m['ranks']) == 1 else 'ranks'} {', '.join(map(str, m['ranks'][:4]))}",
            xy=(m["step"], -0.5), xytext=(0, 3 + 14 * k), textcoords="offset points",
            ha="left" if m["step"] <= mid else "right", va="bottom", fontsize=9, color=colour, fontweight="bold",
            annotation_clip=False,
        )
    seen = set(np.unique(rep.cells).tolist()) | {Cell.AGREE}
    handles = [Patch(facecolor=CELL_COLOURS[c], edgecolor="#b0b8c1", label=CELL_LABELS[c]) for c in codes if c in seen]
    _legend_right(ax, handles)
    return _png(fig)


def _x(rep: Report) -> np.ndarray:
    return rep.bin_steps.astype(float)


def accepted_plot(rep: Report) -> str | None:
    """Accepted tokens per step per rank, and how far each rank got ahead of the median rank."""
    if rep.accepted is None or rep.behind is None:
        return None
    fig, (a1, a2) = _figure([1.7, 1.5], gap_in=0.12)
    x = _x(rep)
    odd = [o for o in _odd_ranks(rep) if o in rep.ranks][: len(_ODD)]
    style = "steps-post" if rep.bin_size == 1 else "default"
    first_other = True
    for i, rank in enumerate(rep.ranks):
        if rank in odd:
            continue
        kw = {"color": "#9aa5b1", "lw": 1.0, "drawstyle": style}
        a1.plot(x, rep.accepted[i], **kw, label="other ranks" if first_other else None)
        a2.plot(x, rep.behind[i], **kw)
        first_other = False
    for j, rank in enumerate(odd):
        i = rep.ranks.index(rank)
        kw = {"color": _ODD[j], "lw": 1.3, "drawstyle": style, "alpha": 0.9}
        a1.plot(x, rep.accepted[i], **kw, label=f"rank {rank}")
        a2.plot(x, rep.behind[i], **kw)
    a1.set_ylabel("accepted per step" if rep.bin_size == 1 else f"accepted per step\n(mean of {rep.bin_size})")
    a2.set_ylabel("tokens ahead of\nthe median rank")
    a2.axhline(0, color=_MUTED, lw=0.8)
    for ax in (a1, a2):
        ax.grid(axis="y", color=_GRID, lw=0.6)
        _mark_divergence(ax, rep, label=ax is a1)
        _steps_axis(ax, rep, label=ax is a2)
    a1.tick_params(labelbottom=False)
    _legend_right(a1)
    return _png(fig)


def _mark_divergence(ax: Any, rep: Report, *, label: bool, sep: str = "\n") -> None:
    d, t = rep.first_divergence, rep.first_token_divergence
    if d is not None:
        ax.axvline(d["step"], color=_INK, lw=0.9, ls=(0, (3, 3)), label=f"first divergence{sep}(step {d['step']})" if label else None)
    if t is not None:
        ax.axvline(t["step"], color=CELL_COLOURS[Cell.TOKENS], lw=1.2, label=f"first token divergence{sep}(step {t['step']})" if label else None)


def margin_plot(rep: Report) -> str | None:
    """Top-1/top-2 margin per step (log scale), divergent steps marked, and its histogram."""
    if rep.margin_min is None or rep.margin_median is None or not rep.margins.size:
        return None
    fig, (ax,) = _figure(3.0, top_in=0.35, bottom_in=0.95)
    box = ax.get_position()
    hx = fig.add_axes((box.x1 + 0.25 / WIDTH_IN, box.y0, (RIGHT_IN - 0.45) / WIDTH_IN, box.height), sharey=ax)
    pos = rep.margins[rep.margins > 0]
    floor = float(pos.min()) / 3 if pos.size else 1e-6
    x = _x(rep)
    y = np.where(rep.margin_min > 0, rep.margin_min, floor)
    if rep.bin_size > 1:
        ax.plot(x, np.where(rep.margin_median > 0, rep.margin_median, floor), color="#b6c2cf", lw=1.0, label="bin median")
    few = x.size <= 400
    ax.plot(x, y, color="#52606d", lw=0.8, marker="o" if few else None, ms=2.2,
            label="smallest over ranks" if rep.bin_size == 1 else "bin minimum")
    ax.set_yscale("log")
    # Steps where tokens differ: a rug along the bottom (often every step after drift; capped).
    tok = rep.token_divergent_steps
    if tok.size:
        show = tok if tok.size <= 3000 else tok[np.linspace(0, tok.size - 1, 3000).astype(int)]
        ax.plot(show, np.full(show.size, floor), ls="none", marker="|", ms=7, color=CELL_COLOURS[Cell.TOKENS],
                alpha=0.5, label="tokens differ", clip_on=False)
    _mark_divergence(ax, rep, label=True, sep=" ")
    at = rep.margin_at
    if at is not None:
        v = at["margin"] if at["margin"] > 0 else floor
        ax.plot([at["step"]], [v], marker="o", ms=7, color=CELL_COLOURS[Cell.TOKENS], zorder=5, path_effects=_halo())
        right = at["step"] > (rep.first_step + rep.last_step) * 0.7
        ax.annotate(f"margin {at['margin']:.3g} at step {at['step']}", xy=(at["step"], v), xytext=(-8 if right else 8, 0),
                    textcoords="offset points", ha="right" if right else "left", va="center", fontsize=9,
                    color=CELL_COLOURS[Cell.TOKENS], fontweight="bold", path_effects=_halo())
    _steps_axis(ax, rep)
    ax.set_ylabel("top-1 − top-2 logit margin")
    ax.grid(axis="y", which="major", color=_GRID, lw=0.6)
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.22), ncol=4, frameon=False, fontsize=9, borderaxespad=0)
    counts, edges = margin_histogram(rep.margins)
    if edges[0] > 0:
        hx.barh(edges[:-1], counts, height=np.diff(edges), align="edge", color="#9aa5b1", edgecolor="white", lw=0.3)
    if at is not None:
        hx.axhline(at["margin"] if at["margin"] > 0 else floor, color=CELL_COLOURS[Cell.TOKENS], lw=1.2)
    hx.set_xlabel("steps")
    hx.set_title("histogram", fontsize=9, color=_MUTED, fontweight="normal", loc="left")
    hx.tick_params(axis="y", which="both", left=False, labelleft=False)
    hx.grid(axis="x", color=_GRID, lw=0.6)
    return _png(fig)


def timeline_plot(rep: Report) -> str | None:
    """Per rank, which graph ran at each step (by bucket), and where steps ran eagerly."""
    if not rep.n_steps:
        return None
    _pyplot()  # matplotlib is there, or the error says what to install
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    r = len(rep.ranks)
    nk = len(rep.graph_keys)
    key_cols = [_KEY_COLOURS[i % len(_KEY_COLOURS)] for i in range(nk)]
    cmap = ListedColormap(["#ffffff", _UNKNOWN, _EAGER] + key_cols)  # -3 none, -2 unknown, -1 eager, keys
    norm = BoundaryNorm(np.arange(-3, nk + 1) - 0.5, cmap.N)
    fig, (ax,) = _figure(_rows_in(r), top_in=0.15)
    ax.imshow(rep.timeline, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
              extent=(rep.first_step - 0.5, rep.last_step + 0.5, r - 0.5, -0.5))
    if rep.bin_size > 1:
        # A bin shows its most frequent graph; a tick above the row says some step in it ran eagerly.
        ys, xs = np.nonzero(rep.eager & (rep.timeline != -1))
        if ys.size:
            ax.plot(rep.bin_steps[xs], ys - 0.36, ls="none", marker="v", ms=3, color=_EAGER, alpha=0.8)
    _rank_ticks(ax, rep.ranks)
    for spine in ax.spines.values():
        spine.set_visible(False)
    _steps_axis(ax, rep)
    _mark_divergence(ax, rep, label=False)
    handles = []
    for i, k in enumerate(rep.graph_keys[:12]):
        pad = f"\npadded to {k['padded']}" if k["padded"] >= 0 else ""
        handles.append(Patch(facecolor=key_cols[i], label=f"{_short(k['key'], 22)}{pad}"))
    if nk > 12:
        handles.append(Patch(facecolor="#ffffff", label=f"+{nk - 12} more graphs"))
    seen = set(np.unique(rep.timeline).tolist())
    if -1 in seen or rep.eager.any():
        handles.append(Patch(facecolor=_EAGER, label="eager"))
    if -2 in seen:
        handles.append(Patch(facecolor=_UNKNOWN, label="not said"))
    _legend_right(ax, handles, ncol=1 if len(handles) <= max(3, r) else 2)
    return _png(fig)


_VERDICT_COLOURS = {"bitwise equal": "#3a9b5b", "within tolerance": "#e6a317", "different": "#d0312d"}


def layer_curve(result: dict[str, Any]) -> str | None:
    """The per-layer error curve of a ``bisect-layers`` result: max abs error per module."""
    mods = [m for m in result.get("modules") or [] if isinstance(m, dict)]
    if not mods:
        return None
    vals = np.array([_num(m.get("max_abs")) for m in mods], dtype=float)
    pos = vals[np.isfinite(vals) & (vals > 0)]
    floor = float(pos.min()) / 10 if pos.size else 1e-8
    y = np.where(np.isfinite(vals) & (vals > 0), vals, floor)
    x = np.arange(len(mods))
    fig, (ax,) = _figure(2.8, top_in=0.2, bottom_in=1.7)
    ax.plot(x, y, color="#9aa5b1", lw=1.0, zorder=1)
    colours = [_VERDICT_COLOURS.get(str(m.get("verdict")), _MUTED) for m in mods]
    ax.scatter(x, y, c=colours, s=22, zorder=2)
    ax.set_yscale("log")
    names = [str(m.get("name", i)) for i, m in enumerate(mods)]
    every = 1 if len(mods) <= 40 else math.ceil(len(mods) / 40)
    ax.set_xticks(x[::every])
    ax.set_xticklabels([_short(n) for n in names[::every]], rotation=60, ha="right", rotation_mode="anchor", fontsize=8)
    first = result.get("first")
    if isinstance(first, str) and first in names:
        i = names.index(first)
        ax.axvline(i, color=_VERDICT_COLOURS["different"], lw=1.2, ls=(0, (3, 3)))
        ax.annotate(f"first that differs: {first}", xy=(i, y[i]), xytext=(-8, 10), textcoords="offset points", ha="right",
                    color=_VERDICT_COLOURS["different"], fontsize=9, fontweight="bold", path_effects=_halo())
    ax.set_ylabel("max abs error" + ("\n(0 shown at the floor)" if (vals == 0).any() else ""))
    ax.grid(axis="y", color=_GRID, lw=0.6)
    _pyplot()  # matplotlib is there, or the error says what to install
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="none", marker="o", color=c, label=v) for v, c in _VERDICT_COLOURS.items()]
    _legend_right(ax, handles)
    ax.set_xlim(-0.7, len(mods) - 0.3)
    return _png(fig)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _short(name: str, n: int = 28) -> str:
    return name if len(name) <= n else "…" + name[-(n - 1) :]
