"""The report's diff section (``replay report A --against B``): the diff's verdict and tables.

It renders ``RunDiff.to_json()``, the same data ``replay diff --json`` prints, so the page and the
command can never disagree. Every value in it comes from a recording and is escaped.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["SECTION_ID", "SECTION_TITLE", "render_diff_section"]

SECTION_ID = "diff"
SECTION_TITLE = "Against another run"

_MAX_ROWS = 64


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _pill(verdict: str) -> str:
    cls = {"the same": "eq", "the same within tolerance": "tol", "different": "diff"}.get(verdict, "other")
    return f'<span class="pill {cls}">{_e(verdict)}</span>'


def _where(f: dict[str, Any] | None) -> str:
    if not f:
        return "–"
    text = f"step {_e(f['step'])} <code>{_e(f['field'])}</code>"
    ma, mb = f.get("margin_a"), f.get("margin_b")
    if ma is not None or mb is not None:
        fm = lambda m: "–" if m is None else f"{m:.3g}"  # noqa: E731
        text += f" (min margin A {fm(ma)}, B {fm(mb)})"
    return text


def render_diff_section(d: dict[str, Any]) -> str:
    """The section as HTML, from ``RunDiff.to_json()``."""
    parts = [_verdict(d), *(f'<p class="how">{_e(n)}</p>' for n in d.get("notes") or [])]
    parts += _streams(d.get("streams") or [])
    parts.append(_first_difference(d.get("first_difference")))
    if d.get("unsharded"):
        rows = [[f"<code>{_e(u['field'])}</code>", _pill(u["verdict"]), _e(u["layout_a"]), _e(u["layout_b"]),
                 _e(u["compared_steps"]), "–" if u["first_step"] is None else _e(u["first_step"]), _e(u["note"])]
                for u in d["unsharded"][:_MAX_ROWS]]
        parts.append("<h3>Compared unsharded</h3>" + _table(["field", "verdict", "layout in A", "layout in B", "steps compared", "first differs", "note"], rows))
    parts.append(_batching(d.get("batching")))
    rows = [[_e(c["category"]), _other(c)] for c in d.get("other_differences") or []]
    parts.append("<h3>What else differs, most likely cause first</h3>" + _table(["what", "A against B"], rows))
    how = ("Run A (this report's recording) against run B, rank by rank: the first step and field whose bits differ, "
           "the first token divergence and the margin there, then the other differences between the runs. "
           "The same data as <code>replay diff A B --json</code>.")
    return f'<section id="{SECTION_ID}"><h2>{SECTION_TITLE}</h2><p class="how">{how}</p>{"".join(parts)}</section>'


def _verdict(d: dict[str, Any]) -> str:
    verdict = str(d.get("verdict", ""))
    tone = {"the same": "good", "the same within tolerance": "warn"}.get(verdict, "bad")
    return (f'<div class="verdict {tone}"><div class="line"><b>{_e(d.get("headline", verdict))}</b></div>'
            f'<div class="line">A: <code>{_e(d.get("a"))}</code></div>'
            f'<div class="line">B: <code>{_e(d.get("b"))}</code></div>'
            f'<div class="line">compared {_e(d.get("tolerance"))}</div></div>')


def _streams(streams: list[dict[str, Any]]) -> list[str]:
    """The streams table, those that differ first (at most _MAX_ROWS rows)."""
    shown = sorted(streams, key=lambda s: (s["verdict"] in ("the same", "the same within tolerance"), s["rank_a"]))[:_MAX_ROWS]
    rows = [[_e(s["stream"]), _pill(s["verdict"]), _where(s.get("first_difference")), _where(s.get("first_token_divergence")),
             f"{_e(s['differing_steps'])} of {_e(s['common_steps'])}", _e("; ".join(s.get("reasons") or []))] for s in shown]
    out = [_table(["ranks", "verdict", "first difference", "first token divergence", "steps differ", "also"], rows)]
    if len(streams) > _MAX_ROWS:
        out.append(f'<p class="none">{len(streams) - _MAX_ROWS} more rank pairs (all the same) are in <code>replay diff --json</code>.</p>')
    return out


def _first_difference(first: dict[str, Any] | None) -> str:
    if first and first.get("comparison"):
        c = first["comparison"]
        facts = [f"{k.replace('_', ' ')} {_e(c[k] if not isinstance(c[k], float) else f'{c[k]:.3g}')}"
                 for k in ("mismatched", "max_abs", "ulp", "argmax_agree", "topk_overlap") if c.get(k) is not None]
        return f"<p>At the first difference: {_pill(c['verdict'])} {', '.join(facts)}</p>"
    if first and first.get("note"):
        return f'<p class="none">At the first difference: {_e(first["note"])}</p>'
    return ""


def _batching(b: dict[str, Any] | None) -> str:
    if not b:
        return ""
    text = _e(b.get("evidence", ""))
    if b.get("aligned"):
        text += f"; aligned by request and position: {_e(b['rows_differ'])} of {_e(b['rows_compared'])} rows differ"
    if b.get("note"):
        text += f"; {_e(b['note'])}"
    return f"<p><b>Batched differently:</b> {text}</p>"


def _other(c: dict[str, Any]) -> str:
    """One row of what else differs: not compared (why), the same, or what differs."""
    if not c.get("compared"):
        return f'<span class="none">{_e(c.get("note"))}</span>'
    if not c.get("differs"):
        return "the same" + (f' <span class="none">({_e(c["note"])})</span>' if c.get("note") else "")
    items = "; ".join(f"<code>{_e(i.get('name'))}</code>: A {_e(i.get('a'))}, B {_e(i.get('b'))}" for i in c["items"][:8])
    more = f"; … {c['count'] - 8} more" if c["count"] > 8 else ""
    return f'<span class="pill diff">{_e(c["count"])} differ</span> {items}{more}'
