"""One self-contained HTML page: inline CSS, images as data URIs, no scripts, no network.

Everything taken from the recording or from saved results is escaped; results files are data,
and one that has an unexpected shape is shown as "could not be shown", never fatal.
"""

from __future__ import annotations

import html
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from replay.analysis.divergence import NO_OUTPUT_FIELDS, STATUS_FIELD
from replay.analysis.summary import divergence_what, rank_only_note, verdict_line
from replay.errors import ReplayError
from replay.report import plots
from replay.report.data import Report, check_report_path
from replay.states import ResultKind

__all__ = ["SECTIONS", "render_html", "write_report"]

SECTIONS = [
    ("summary", "Summary"),
    ("agreement", "Agreement map"),
    ("accepted", "Accepted tokens"),
    ("margins", "Logit margins"),
    ("timeline", "Graphs and eager fallbacks"),
    ("tuner", "Tuner choices and graph kernels"),
    ("results", "Saved step and bisect results"),
]

_CSS = """
:root{--ink:#1f2933;--muted:#616e7c;--line:#e4e7eb;--bg:#f5f7fa;--red:#d0312d;--green:#2f8a4f;--amber:#b7791f}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:14px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1200px;margin:0 auto;padding:20px 24px 48px}
header h1{font-size:22px;margin:0 0 2px}
header .sub{color:var(--muted);font-size:13px;word-break:break-all}
nav{margin:12px 0 18px;font-size:13px}
nav a{color:#3e6a9e;text-decoration:none;margin-right:14px;white-space:nowrap}
nav a:hover{text-decoration:underline}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:16px 20px 18px;margin:0 0 18px}
section h2{font-size:17px;margin:0 0 4px}
p.how{color:var(--muted);margin:0 0 10px;font-size:13px;max-width:980px}
img.plot{display:block;width:100%;max-width:1254px;height:auto;margin:6px 0 2px}
.verdict{border-radius:6px;padding:12px 16px;margin:4px 0 14px;font-size:15px}
.verdict.bad{background:#fdecec;border-left:5px solid var(--red)}
.verdict.good{background:#e9f6ee;border-left:5px solid var(--green)}
.verdict.warn{background:#fff6e0;border-left:5px solid var(--amber)}
.verdict b{font-weight:650}
.verdict .line{margin:2px 0}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px 18px;margin:6px 0 8px}
.fact .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.03em}
.fact .v{font-size:16px;font-weight:600}
code,pre{font:12.5px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre.cmd{background:#1f2933;color:#f5f7fa;border-radius:6px;padding:8px 12px;margin:8px 0 0;overflow-x:auto}
table{border-collapse:collapse;font-size:13px;margin:6px 0 4px}
th,td{border-bottom:1px solid var(--line);padding:4px 12px 4px 0;text-align:left;vertical-align:top}
th{color:var(--muted);font-weight:600;font-size:12px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.odd{background:#fdecec;color:#8a1c1a;font-weight:600}
td code{word-break:break-all}
.scroll{overflow-x:auto}
.pill{display:inline-block;border-radius:10px;padding:0 8px;font-size:12px;font-weight:600;white-space:nowrap}
.pill.eq{background:#e3f4e8;color:#1e6b3b}.pill.tol{background:#fff1d6;color:#8a5a00}.pill.diff{background:#fde2e1;color:#9b1c1c}.pill.other{background:#eceff3;color:#52606d}
.result{border-top:1px solid var(--line);padding-top:10px;margin-top:12px}
.result:first-of-type{border-top:none;margin-top:0}
.result h3{font-size:14px;margin:0 0 4px}
.result p{margin:3px 0}
details summary{cursor:pointer;color:var(--muted);font-size:13px;margin:4px 0}
.result .file{color:var(--muted);font-weight:normal;font-size:12px}
.none{color:var(--muted);font-style:italic}
footer{color:var(--muted);font-size:12px;text-align:center}
"""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _img(b64: str | None, alt: str) -> str:
    if not b64:
        return ""
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v[:20]) + (" …" if len(v) > 20 else "")
    if isinstance(v, dict):
        return ", ".join(f"{_e(k)}: {_fmt(x)}" for k, x in list(v.items())[:20])
    s = str(v)
    return _e(s if len(s) <= 300 else s[:300] + "…")


def _ranks(rs: Iterable[Any]) -> str:
    rs = list(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _table(headers: list[str], rows: Sequence[Sequence[str | tuple[str, str]]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            if isinstance(c, tuple):  # (html, css class)
                cells.append(f'<td class="{c[1]}">{c[0]}</td>')
            else:
                cells.append(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _section(sid: str, how: str, body: str) -> str:
    title = dict(SECTIONS)[sid]
    return f'<section id="{sid}"><h2>{title}</h2><p class="how">{how}</p>{body}</section>'


# -- sections -------------------------------------------------------------------------------


def _summary(rep: Report) -> str:
    verdict, grid = _verdict(rep), _facts(rep)
    return _section("summary", "Where the ranks first disagree, and what to run next.",
                    verdict + grid + _streams(rep.summary) + "".join(_rank_notes(rep.summary)) + _next_commands(rep))


def _verdict(rep: Report) -> str:
    d, t = rep.first_divergence, rep.first_token_divergence
    lines = []
    if d is None and len(rep.ranks) < 2:
        # One rank: nothing was compared across ranks, so there is no verdict about them.
        cls = "warn"
        lines.append("<b>One rank</b>: nothing to compare across ranks; re-run a step against its recording with "
                     "<code>replay step</code> to check it.")
    elif d is None and rep.summary.get("output_fields") is False:
        cls = "warn"
        lines.append(f"<b>Nothing compared</b>: {_e(verdict_line(rep.summary) if rank_only_note(rep.summary) else NO_OUTPUT_FIELDS)}.")
    elif d is None:
        cls = "good"
        only = rank_only_note(rep.summary)
        lines.append("<b>No divergence</b>: every rank recorded the same bits at every common step"
                     + (f" in the fields they all record; {_e(only)}." if only else "."))
    else:
        cls = "bad" if t is not None else "warn"
        if d.get("field") == STATUS_FIELD:
            lines.append(f"<b>First divergence: {_at(d)}</b>: {_e(divergence_what(d))}.")
        else:
            majority = d.get("majority_text") or f"majority: {', '.join(map(str, d['majority']))}"
            lines.append(f"<b>First divergence: {_at(d)}, {_ranks(d['ranks'])}, field <code>{_e(d['field'])}</code></b> "
                         f"({_e(majority)}).")
        if t is not None:
            lines.append(f"<b>First token divergence: {_at(t)}, {_ranks(t['ranks'])}</b> (<code>{_e(t['field'])}</code>).")
        else:
            lines.append(_no_token_divergence(rep.summary))
    at = rep.margin_at
    if at is not None:
        per = ", ".join(f"r{r} {_fmt(m)}" for r, m in list(at["per_rank"].items())[:16])
        rank_of = "the smallest of the whole run" if at["percentile"] == 0 else f"{at['percentile']:.1f}% of steps had a smaller one"
        lines.append(f"Smallest top-1/top-2 logit margin of the step's rows: {_fmt(at['margin'])} ({per}); {rank_of}.")
    s = rep.summary
    for td in s.get("tuner_differences", [])[:3]:
        lines.append(f"Tuner choice differs for <code>{_e(td['op'])}</code>: " + ", ".join(f"r{_e(r)} {_e(c)}" for r, c in td["choices"].items()))
    if len(s.get("kernel_differences", [])):
        lines.append(f"Captured graphs hold different kernels on different ranks ({len(s['kernel_differences'])} graph keys): see below.")
    return f'<div class="verdict {cls}">' + "".join(f'<div class="line">{x}</div>' for x in lines) + "</div>"


def _no_token_divergence(s: dict[str, Any]) -> str:
    """What the page says of tokens when no token divergence was found: as ``info`` says it, never
    "sampled the same tokens" where no token was recorded to compare."""
    if s.get("output_fields") is False:
        return "No step output recorded: only what went into the steps was compared, so the ranks may have differed earlier."
    if s.get("token_fields") is False:
        return "No token field recorded: the ranks differ in bits; what they sampled was not recorded as tokens."
    if s.get("offset_at_divergence"):
        return "No token divergence once the offset is taken into account."
    return "No token divergence: the ranks differ in bits but sampled the same tokens."


def _at(d: dict[str, Any]) -> str:
    """``step 9``, or ``step 9 (stream draft, its step 4)`` when the loop runs several models."""
    if d.get("stream") is None:
        return f"step {_e(d['step'])}"
    return f"step {_e(d['step'])} (stream {_e(d['stream'])}, its step {_e(d.get('stream_step', '?'))})"


def _streams(s: dict[str, Any]) -> str:
    """Several models in one loop: each one's step sequence and, across ranks, first divergence."""
    streams = s.get("streams") or []
    if not streams:
        return ""
    compared = len(s.get("ranks", [])) > 1
    rows = []
    for x in streams:
        d = x.get("first_divergence")
        row = [_e(x["stream"]), _e(x["steps"]), _e(x["first_step"]), _e(x["last_step"])]
        if compared:
            row.append(f"{_at(d)}: <code>{_e(d['field'])}</code> on {_ranks(d['ranks'])}" if d else "none across ranks")
        rows.append(row)
    head = ["stream", "steps", "first step", "last step"] + (["first divergence"] if compared else [])
    return (f"<p>{len(streams)} models in one loop (draft and target, say), one step sequence each; step numbers count "
            "all of them, in program order.</p>" + _table(head, rows, numeric={1, 2, 3}))


def _facts(rep: Report) -> str:
    s = rep.summary
    complete = sum(1 for r in s.get("ranks", []) if r.get("complete"))
    eager = sum(r["eager_steps"] for r in rep.rank_runs)
    graphs = sum(r["graph_steps"] for r in rep.rank_runs)
    facts = [
        ("part", _e(rep.part) + (f" <span class='sub'>(of {len(rep.parts)})</span>" if len(rep.parts) > 1 else "")),
        ("world size", _e(s.get("world_size", len(rep.ranks)))),
        ("ranks complete", f"{complete} / {len(rep.ranks)}"),
        ("steps", f"{rep.first_step}–{rep.last_step}" if rep.n_steps else "none"),
        ("steps that differ", f"{rep.divergent_steps.size:,}"),
        ("steps where tokens differ", f"{rep.token_divergent_steps.size:,}" if s.get("token_fields") is not False else "not recorded"),
        ("graph / eager steps", f"{graphs:,} / {eager:,}"),
        ("saved results", str(len(rep.results))),
    ]
    return '<div class="facts">' + "".join(f'<div class="fact"><div class="k">{k}</div><div class="v">{v}</div></div>' for k, v in facts) + "</div>"


def _rank_notes(s: dict[str, Any]) -> list[str]:
    extra = []
    if s.get("missing_ranks"):
        extra.append(f"<p>Ranks with no file: {_e(', '.join(map(str, s['missing_ranks'])))}.</p>")
    for u in s.get("unreadable_ranks", []):
        extra.append(f"<p>Rank {_e(str(u['rank']))} is left out: {_e(u['problem'])}</p>")
    for r in s.get("ranks", []):
        if r.get("problem"):
            extra.append(f"<p>Rank {r['rank']}: {_e(r['problem'])}</p>")
        if r.get("last_error"):
            extra.append(f"<p>Rank {r['rank']} raised: <code>{_e(r['last_error'])}</code></p>")
    return extra


def _next_commands(rep: Report) -> str:
    """Commands that work here: no ``--mode`` (``replay step`` picks what the recording and this
    machine can run), and eager against CUDA graphs only where graphs ran."""
    run = _e(rep.recording)
    target = rep.first_token_divergence or rep.first_divergence
    if target is None:
        if len(rep.ranks) != 1 or not rep.n_steps:
            return ""
        return f'<pre class="cmd">replay step {run} --rank {_e(rep.ranks[0])} --step {_e(rep.last_step)}</pre>'
    rank, step = target["ranks"][0], target["step"]
    graphs = sum(r["graph_steps"] for r in rep.rank_runs)
    # bisect layers puts its taps on a model it builds: with no factory recorded, it needs one.
    factory = "" if rep.has_factory else (" --factory MODULE:QUALNAME   # the recording names no factory: "
                                          "a callable that builds the model, (config, *, rank, world_size, device, options)")
    # Ranks that differ: their two re-runs side by side find the first module that computes
    # otherwise (a re-run against its own recording would reproduce, and find nothing).
    majority = target.get("majority") or []
    bisects = [f"--step {_e(step)} --between rank:{_e(majority[0])},rank:{_e(rank)}"] if majority else []
    if graphs:
        bisects.append(f"--rank {_e(rank)} --step {_e(step)} --between eager,cudagraph")
    if not bisects:
        bisects.append(f"--rank {_e(rank)} --step {_e(step)} --between recorded,rerun")
    return (f'<pre class="cmd">replay step {run} --rank {_e(rank)} --step {_e(step)}\n'
            + "\n".join(f"replay bisect layers {run} {b}{_e(factory)}" for b in bisects) + "</pre>")


def _agreement(rep: Report) -> str:
    binned = f" Each column is {rep.bin_size} steps and shows the most severe difference in it." if rep.bin_size > 1 else ""
    how = (
        "One row per rank, one column per step. At each step the ranks vote on their recorded digests; "
        "a cell is coloured when its rank differs from the majority, by what differs "
        f"(tokens, output bits, a collective, inputs, or only the graph that ran).{binned} "
        "The circle marks the first divergence."
    )
    if not rep.n_steps:
        return _section("agreement", how, '<p class="none">No steps were recorded.</p>')
    return _section("agreement", how, _img(plots.agreement_map(rep), "ranks x steps agreement map"))


def _accepted(rep: Report) -> str:
    how = (
        "Accepted tokens per step for each rank (speculative decoding), and each rank's running total "
        "minus the median rank's: once a rank accepts a different number of draft tokens its positions "
        "and KV cache no longer match the others."
    )
    img = plots.accepted_plot(rep) if rep.n_steps else None
    body = _img(img, "accepted tokens per step per rank") if img else '<p class="none">The recording has no accepted-token counts.</p>'
    return _section("accepted", how, body)


def _margins(rep: Report) -> str:
    how = (
        "The gap between the top-1 and top-2 logit (smallest over a step's rows and over ranks) on a log "
        "scale, with the histogram of all steps at the right. A token divergence at a margin near the "
        "numeric noise is a near-tie being flipped by bit-level differences; red ticks mark steps where tokens differ."
    )
    img = plots.margin_plot(rep) if rep.n_steps else None
    body = _img(img, "top-1/top-2 margin per step") if img else '<p class="none">The recording has no logit margins.</p>'
    return _section("margins", how, body)


def _timeline(rep: Report) -> str:
    how = (
        "Which captured graph (bucket and padded size) each rank replayed at each step, and where it ran eagerly "
        "instead. Ranks running different graphs, or one rank silently falling back to eager, show as different colours."
    )
    img = plots.timeline_plot(rep)
    rows = []
    for r in rep.rank_runs:
        reasons = "; ".join(f"{_e(k)} ({v})" for k, v in r["eager_reasons"].items()) or "–"
        first = ", ".join(map(str, r["first_eager"])) + (" …" if r["eager_steps"] > len(r["first_eager"]) else "")
        rows.append([str(r["rank"]), str(r["graphs_captured"]), f"{r['graph_steps']:,}", f"{r['eager_steps']:,}", first or "–", reasons])
    table = _table(["rank", "graphs captured", "graph steps", "eager steps", "first eager steps", "why eager"], rows, {1, 2, 3})
    return _section("timeline", how, _img(img, "graph timeline per rank") + table)


def _tuner(rep: Report) -> str:
    how = (
        "Autotuner choices and the kernels inside each captured graph, shown only where ranks differ; "
        "cells that differ from the majority are highlighted. Per-rank tuning that picks different kernels "
        "gives each rank different bits."
    )
    parts = []
    if rep.tuner_rows:
        ranks = sorted({r for row in rep.tuner_rows for r in row["choices"]}, key=_int)
        rows = [
            [f"<code>{_e(row['op'])}</code>"]
            + [(_fmt(row["choices"].get(r)), "odd" if row["choices"].get(r) != row["majority"] else "") for r in ranks]
            for row in rep.tuner_rows
        ]
        parts.append(f"<h3>Tuner choices ({len(rep.tuner_rows)} ops differ, {rep.tuner_agreeing} agree)</h3>")
        parts.append(_table(["op"] + [f"rank {_e(r)}" for r in ranks], rows))
    else:
        parts.append(f'<p class="none">Tuner choices agree on every rank ({rep.tuner_agreeing} ops recorded).</p>')
    if rep.kernel_tables:
        for kt in rep.kernel_tables:
            ranks = kt["ranks"]
            rows = [
                [str(row["ordinal"])]
                + [(f"<code>{_fmt(row['kernels'].get(r))}</code>", "odd" if row["kernels"].get(r) != row["majority"] else "") for r in ranks]
                for row in kt["rows"]
            ]
            counts = ", ".join(f"r{_e(r)} {n}" for r, n in kt["n_kernels"].items())
            parts.append(f"<h3>Graph <code>{_e(kt['key'])}</code>: kernels that differ (kernels per rank: {counts})</h3>")
            parts.append(_table(["#"] + [f"rank {_e(r)}" for r in ranks], rows, {0}))
            if kt["more_rows"]:
                parts.append(f'<p class="none">… and {kt["more_rows"]} more rows.</p>')
    else:
        parts.append('<p class="none">Every captured graph holds the same kernels on every rank.</p>')
    return _section("tuner", how, "".join(parts))


def _int(x: Any) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return 1 << 30


def _pill(verdict: Any) -> str:
    v = str(verdict)
    cls = {"bitwise equal": "eq", "within tolerance": "tol", "different": "diff"}.get(v, "other")
    return f'<span class="pill {cls}">{_e(v)}</span>'


def _result_step(r: dict[str, Any]) -> str:
    """A saved ``replay step`` result: what ran, per mode what it found, and its verdicts.

    Saved results are data from disk: every field is checked for its type before it is shown."""
    lines = [_step_head(r)] + _mode_facts(r.get("modes"))
    headline = r.get("headline")
    if isinstance(headline, str) and headline:
        lines.insert(0, f"<b>{_e(headline)}</b>")  # the verdict `replay step` led with
    notes = [n for n in r.get("notes") or [] if isinstance(n, str)] if isinstance(r.get("notes"), list) else []
    extra = "".join(f'<p class="none">{_e(n)}</p>' for n in notes[:10])
    # A step that raised, or whose outputs had nothing recorded to compare with, has no verdict:
    # the table says why, not that none was recorded.
    problem = r.get("problem") if isinstance(r.get("problem"), str) else None
    empty = f"Nothing was compared: {_e(problem)}" if problem else None
    return "".join(f"<p>{x}</p>" for x in lines) + _verdict_table(r.get("verdicts"), empty) + extra


def _step_head(r: dict[str, Any]) -> str:
    head = [f"rank {_fmt(r.get('rank'))}, step {_fmt(r.get('step'))}"]
    modes = r.get("modes")
    if isinstance(modes, dict):
        head.append("modes " + ", ".join(_e(m) for m in modes))
    elif modes:
        head.append(f"modes {_fmt(modes)}")
    for key, label in (("device", "on"), ("keyframe", "from keyframe at step")):
        if isinstance(r.get(key), (str, int)) and not isinstance(r.get(key), bool):
            head.append(f"{label} {_fmt(r[key])}")
    return ", ".join(head)


def _mode_facts(modes: Any) -> list[str]:
    if not isinstance(modes, dict):
        return []
    lines = []
    for name, m in modes.items():
        if not isinstance(m, dict):
            continue
        facts = []
        if isinstance(m.get("repeats_equal"), bool):
            facts.append("repeats equal" if m["repeats_equal"] else "<b>repeats differ</b> (nondeterministic)")
        if isinstance(m.get("error"), str):
            facts.append(f"<b>raised {_e(m['error'])}</b> in the re-run")
        dep = m.get("departed")
        if isinstance(dep, dict):
            facts.append(f"departed from the recording at step {_fmt(dep.get('step'))} ({_fmt(dep.get('field'))})")
        if facts:
            lines.append(f"{_e(name)}: " + "; ".join(facts))
    return lines


def _verdict_table(raw: Any, empty: str | None = None) -> str:
    verdicts = [v for v in raw or [] if isinstance(v, dict)] if isinstance(raw, list) else []
    has_output = any("output" in v for v in verdicts)
    cols = ["max_abs", "max_rel", "ulp", "argmax_agree", "topk_overlap", "margin"]
    rows = []
    for v in verdicts:
        diff = f"{_fmt(v.get('mismatched'))} / {_fmt(v.get('numel'))}" if v.get("numel") else "–"
        row = [_fmt(v.get("a")), _fmt(v.get("b"))] + ([_fmt(v.get("output"))] if has_output else [])
        rows.append(row + [_pill(v.get("verdict", "?"))] + [_fmt(v.get(c)) for c in cols] + [diff, _fmt(v.get("note", ""))])
    if not rows:
        return f'<p class="none">{empty or "No verdicts recorded."}</p>'
    heads = ["a", "b"] + (["output"] if has_output else []) + ["verdict", "max abs", "max rel", "ulp", "argmax agrees",
                                                               "top-k overlap", "margin", "elements differ", "note"]
    first_num = 4 if has_output else 3
    return _table(heads, rows, set(range(first_num, first_num + 7)))


def _result_bisect_steps(r: dict[str, Any]) -> str:
    first = r.get("first", r.get("first_step", r.get("step")))
    return f"<p>First step that differs: <b>{_fmt(first)}</b>; ranks: {_fmt(r.get('ranks'))}.</p>" + _other_keys(r, {"first", "first_step", "step", "ranks"})


def _result_bisect_layers(r: dict[str, Any]) -> str:
    between = r.get("between")
    head = f"rank {_fmt(r.get('rank'))}, step {_fmt(r.get('step'))}" + (f", {_fmt(between[0])} vs {_fmt(between[1])}" if isinstance(between, list) and len(between) == 2 else "")
    first = r.get("first")
    head += f"; first module that differs: <b><code>{_fmt(first)}</code></b>" if first else "; no module differs"
    img = plots.layer_curve(r)
    mods = [m for m in r.get("modules") or [] if isinstance(m, dict)]
    rows = [[str(i), f"<code>{_fmt(m.get('name'))}</code>", _pill(m.get("verdict", "?")), _fmt(m.get("max_abs")), _fmt(m.get("max_rel"))] for i, m in enumerate(mods[:300])]
    table = _table(["#", "module", "verdict", "max abs", "max rel"], rows, {0, 3, 4}) if rows else ""
    more = f'<p class="none">… and {len(mods) - 300} more modules.</p>' if len(mods) > 300 else ""
    return f"<p>{head}</p>{_img(img, 'per-layer error curve')}<details><summary>modules ({len(mods)})</summary>{table}{more}</details>"


def _result_bisect_config(r: dict[str, Any]) -> str:
    tried = r.get("toggles") or r.get("tried") or []
    minimal = r.get("minimal", r.get("minimal_set"))
    out = f"<p>Smallest set of toggles that flips the outcome: <b>{_fmt(minimal) if minimal else 'none found'}</b></p>"
    rows = []
    if isinstance(tried, list):
        for t in tried[:200]:
            if isinstance(t, dict):
                rows.append([_fmt(t.get("toggles", t.get("name", t.get("set")))), _fmt(t.get("outcome", t.get("verdict", t.get("result"))))])
            else:
                rows.append([_fmt(t), ""])
    elif isinstance(tried, dict):
        rows = [[_e(k), _fmt(v)] for k, v in list(tried.items())[:200]]
    if rows:
        out += _table(["toggles tried", "outcome"], rows)
    return out


def _other_keys(r: dict[str, Any], skip: set[str]) -> str:
    skip = skip | {"kind", "part", "_file", "_mtime"}
    rest = [(k, v) for k, v in r.items() if k not in skip and isinstance(v, (str, int, float, bool))]
    if not rest:
        return ""
    return '<p class="none">' + "; ".join(f"{_e(k)}: {_fmt(v)}" for k, v in rest[:20]) + "</p>"


_RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    ResultKind.STEP: _result_step,
    ResultKind.BISECT_STEPS: _result_bisect_steps,
    ResultKind.BISECT_LAYERS: _result_bisect_layers,
    ResultKind.BISECT_CONFIG: _result_bisect_config,
}


def _results(rep: Report) -> str:
    how = (
        "Results of <code>replay step</code> and <code>replay bisect</code> saved in the recording's "
        "<code>results/</code> folder: verdicts of re-runs, the first differing step, the per-layer error "
        "curve, the smallest set of configuration toggles that flips the outcome."
    )
    blocks = []
    unknown = []
    for r in rep.results:
        kind = r.get("kind")
        fn = _RENDERERS.get(kind) if isinstance(kind, str) else None
        name = _e(r.get("_file", ""))
        if fn is None:
            unknown.append(f"{name} (kind {_e(kind)})")
            continue
        try:
            body = fn(r)
        except Exception as e:  # noqa: BLE001 - a results file is data; a strange one is skipped, not fatal
            body = f'<p class="none">could not be shown ({_e(type(e).__name__)})</p>'
        part = f", part {_e(r['part'])}" if isinstance(r.get("part"), str) else ""
        blocks.append(f'<div class="result"><h3>{_e(kind)} <span class="file">{name}{part}</span></h3>{body}</div>')
    if not blocks:
        blocks.append(f'<p class="none">No saved results yet: run <code>replay step {_e(rep.recording)} --rank R --step S</code> or <code>replay bisect</code>.</p>')
    notes = []
    if unknown:
        notes.append("Not shown (kind unknown to this version): " + "; ".join(unknown) + ".")
    if rep.skipped_results:
        notes.append("Skipped: " + "; ".join(_e(s) for s in rep.skipped_results) + ".")
    foot = "".join(f'<p class="none">{n}</p>' for n in notes)
    return _section("results", how, "".join(blocks) + foot)


def render_html(rep: Report) -> str:
    """The report page as one string (needs matplotlib for the figures)."""
    from replay._version import __version__

    title = f"replay report: {Path(rep.recording).name}"
    sub = _e(rep.recording) + (f" · <code>{_e(rep.command)}</code>" if rep.command else "")
    nav = "".join(f'<a href="#{sid}">{name}</a>' for sid, name in SECTIONS)
    body = "".join(
        [_summary(rep), _agreement(rep), _accepted(rep), _margins(rep), _timeline(rep), _tuner(rep), _results(rep)]
    )
    if rep.diff is not None:  # issue 17: `replay report A --against B` leads with the diff
        from replay.report.diff_section import SECTION_ID, SECTION_TITLE, render_diff_section

        nav = f'<a href="#{SECTION_ID}">{SECTION_TITLE}</a>' + nav
        body = render_diff_section(rep.diff) + body
    made = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
        f'<header><h1>{_e(title)}</h1><div class="sub">{sub}</div></header>'
        f"<nav>{nav}</nav>{body}"
        f"<footer>Made by replay {_e(__version__)} on {made}; make it again with <code>replay report {_e(rep.recording)}</code>.</footer>"
        "</main></body></html>\n"
    )


def write_report(rep: Report, out: str | os.PathLike | None = None) -> Path:
    """Write the page to ``out`` (default ``<recording>/report.html``) atomically; return its path."""
    path = Path(out) if out is not None else Path(rep.recording) / "report.html"
    check_report_path(path)
    page = render_html(rep)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html.tmp", dir=path.parent if str(path.parent) else ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(page)
            # issue 16: inside the recording the page gets the recording's mode (owner-only by default)
            from replay.format import perms as _perms

            os.chmod(tmp, _perms.file_mode() if out is None else 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise ReplayError(f"cannot write {path} ({e.strerror or e}): give another place with -o FILE") from None
    return path

