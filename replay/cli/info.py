"""``replay info``: what a recording holds and where its ranks first disagree."""

from __future__ import annotations

from pathlib import Path

import click

from replay.analysis.summary import choose_part, summarize_part
from replay.cli.common import emit_json, json_option, open_run, part_option, run_argument, unreadable_exit
from replay.cli.render import fmt_margin, style, table
from replay.errors import RecordingDamaged
from replay.format.reader import Recording


@click.command(epilog="\b\nExamples:\n  replay info\n  replay info recordings/20261130-120000-test_mtp --json")
@run_argument
@part_option
@json_option
def info(run: Path | None, root: str, part: str | None, as_json: bool) -> int:
    """Summarise RUN (default: the newest recording): ranks, steps, graphs, first divergence."""
    with open_run(run, root) as rec:
        out = info_data(rec, part)
    if as_json:
        emit_json(out)
    else:
        click.echo(render_info(out))
    return unreadable_exit(out)


def info_data(rec: Recording, part: str | None = None) -> dict:
    """What ``replay info`` shows, as one JSON-safe dict (also printed by ``replay record``)."""
    chosen = choose_part(rec, part)
    summary = summarize_part(chosen)
    parts = []
    for name, p in rec.items():
        try:
            s = summary if p is chosen else summarize_part(p, with_details=False)
        except RecordingDamaged as e:  # another part, none of whose rank files can be read
            parts.append({"name": name, "world_size": p.world_size, "diverged": None, "token_diverged": None,
                          "problem": str(e)})
            continue
        parts.append({"name": name, "world_size": p.world_size, "diverged": s["first_divergence"] is not None,
                      "token_diverged": s["first_token_divergence"] is not None})
    return {"recording": str(rec.path), "command": rec.manifest.get("command"), "parts": parts, **summary}


def render_info(s: dict) -> str:
    lines = [f"recording   {s['recording']}"]
    if s.get("command"):
        # The manifest is data from disk: render whatever is there, never fail on its type.
        c = s["command"]
        cmd = " ".join(map(str, c)) if isinstance(c, list) else str(c)
        lines.append(f"command     {cmd}")
    if len(s["parts"]) > 1:
        marks = [f"{p['name']}{' (diverged)' if p['diverged'] else ''}{' (cannot be read)' if p.get('problem') else ''}"
                 for p in s["parts"]]
        lines.append(f"parts       {', '.join(marks)}; showing {s['part']}")
    lines.append(f"world size  {s['world_size']}")
    rows = []
    for r in s["ranks"]:
        state = "live" if r["live"] else ("yes" if r["complete"] else style("no", fg="yellow"))
        where = r["host"] + (f" (node {r['node_rank']})" if r.get("node_rank") is not None else "")
        rows.append([r["rank"], r["steps"], state, r["graphs_captured"], r["graph_steps"], r["eager_steps"], r["raised_steps"], where])
    lines.append(table(["rank", "steps", "complete", "graphs", "graph steps", "eager steps", "raised", "host"], rows))
    for m in s["missing_ranks"]:
        lines.append(style(f"  rank {m}: no file", fg="red"))
    for u in s["unreadable_ranks"]:
        lines.append(style(f"  rank {u['rank']}: left out, {u['problem']}", fg="red"))
    for r in s["ranks"]:
        if r["problem"]:
            lines.append(style(f"  rank {r['rank']}: {r['problem']}", fg="yellow"))
        if r["last_error"]:
            lines.append(f"  rank {r['rank']} raised: {r['last_error']}")
    d, t = s["first_divergence"], s["first_token_divergence"]
    if d is None and s["unreadable_ranks"] and len(s["ranks"]) < 2:
        lines.append("no divergence to look for: fewer than two ranks can be read")
    elif d is None:
        read = "every rank that can be read" if s["unreadable_ranks"] else "every rank"
        lines.append(style(f"no divergence: {read} recorded the same bits at every common step", fg="green"))
    else:
        lines.append(style(f"first divergence        step {d['step']}: {d['field']} differs on rank(s) "
                           f"{', '.join(map(str, d['ranks']))} (majority: {', '.join(map(str, d['majority']))})", fg="red", bold=True))
    if t is not None:
        lines.append(style(f"first token divergence  step {t['step']}: {t['field']} differs on rank(s) "
                           f"{', '.join(map(str, t['ranks']))}", fg="red", bold=True))
        margins = s.get("margin_at_token_divergence", {})
        if margins:
            lines.append("  top-1/top-2 margin there: " + ", ".join(f"r{r} {fmt_margin(m)}" for r, m in margins.items()))
    elif d is not None:
        lines.append("no token divergence: the ranks differ in bits but sampled the same tokens")
    for td in s.get("tuner_differences", []):
        lines.append(f"tuner choice differs     {td['op']}: " + ", ".join(f"r{r} {c or 'default'}" for r, c in td["choices"].items()))
    for kd in s.get("kernel_differences", []):
        only = "; ".join(f"rank {r} only: {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}" for r, v in kd["only_on"].items())
        at = kd.get("at_first_difference", {})
        groups: dict[str, list[str]] = {}
        for r, k in at.items():
            groups.setdefault(str(k), []).append(r)
        where = f"first difference at kernel #{kd.get('first_difference')}: " + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {','.join(rs)} {k}" for k, rs in groups.items())
        lines.append(f"graph kernels differ     {kd['key']}: {where}" + (f" ({only})" if only else ""))
    target = t or d
    if target is not None:
        lines.append(f"next: replay step --rank {target['ranks'][0]} --step {target['step']} --mode both")
    return "\n".join(lines)
