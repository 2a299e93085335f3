"""``replay diff A B``: two runs compared; the first line is the verdict; exit codes as diff(1)."""

from __future__ import annotations

from typing import Any

import click

from replay.analysis.diff import DiffOptions, RecordingDiff, RunDiff, diff as diff_recordings
from replay.cli.common import emit_json, json_option
from replay.cli.render import style, table
from replay.errors import UsageError
from replay.textsafe import escape

EPILOG = """\b
Examples:
  replay diff recordings/good recordings/bad
  replay diff recA:run-000/3 recB:run-000/0      one rank of each
  replay diff tp8 tp1 --shard output.hidden=1     plain-tensor TP with no recorded layout
  replay diff recA recB --rtol 1e-3 --atol 1e-5   values within tolerance count as the same
  replay diff recA recB --json | jq .first_difference
\b
Exit status: 0 the same, 1 different (or not shown to be the same), 2 usage, 3 not found,
4 damaged, 5 written by a newer replay.
"""

_MAX_STREAM_ROWS = 16


def _shard(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        name, sep, dim = v.rpartition("=")
        try:
            out[name] = int(dim)
        except ValueError:
            name = ""
        if not sep or not name:
            raise UsageError(f"--shard {v!r}: write FIELD=DIM, e.g. --shard output.hidden=1")
    return out


@click.command(epilog=EPILOG)
@click.argument("a")
@click.argument("b")
@click.option("--rtol", type=float, default=None, help="Relative tolerance, for fields kept in full (given alone: --atol 0).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance, for fields kept in full (given alone: --rtol 0).")
@click.option("--ulp", type=int, default=None, help="Largest ULP distance allowed (fields kept in full only).")
@click.option("--topk", type=int, default=5, show_default=True, help="k of the top-k agreement shown for logits.")
@click.option("--shard", "shards", multiple=True, callback=_shard, metavar="FIELD=DIM",
              help="Declare a field sharded along DIM over a part's ranks (plain-tensor TP with no recorded layout).")
@click.option("--max-tensor-compares", type=int, default=1000, show_default=True,
              help="Most tensors read per stream for tolerance, or steps per unsharded field.")
@json_option
def diff(a: str, b: str, rtol: float | None, atol: float | None, ulp: int | None, topk: int,
         shards: dict[str, int], max_tensor_compares: int, as_json: bool) -> int:
    """Compare run A with run B: what differs first, then what else differs, likeliest cause first.

    A and B are recordings, parts or ranks: PATH, PATH:PART or PATH:PART/RANK (recA:run-000/3).
    Bitwise unless --rtol/--atol/--ulp is given.
    """
    opts = DiffOptions(rtol=rtol, atol=atol, ulp=ulp, topk=topk, shards=shards, max_tensor_compares=max_tensor_compares)
    result = diff_recordings(a, b, opts)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(render_recording_diff(result) if isinstance(result, RecordingDiff) else render_diff(result))
    return result.exit_code


def _e(v: Any) -> str:
    return escape(v)


def _margins(f: dict[str, Any] | Any) -> str:
    ma, mb = f.margin_a, f.margin_b
    if ma is None and mb is None:
        return ""
    fm = lambda m: "-" if m is None else f"{m:.3g}"  # noqa: E731
    return f" (min margin A {fm(ma)}, B {fm(mb)})"


def _where(f: Any) -> str:
    return "-" if f is None else f"{f.where} {_e(f.field)}"


def _comparison_line(f: Any, bitwise: bool = False) -> str:
    c = f.comparison
    if c is None:
        return _e(f.note) if f.note else ""
    bits = []
    if c.get("mismatched") is not None and c.get("numel"):
        bits.append(f"{c['mismatched']}/{c['numel']} elements differ")
    if c.get("max_abs") is not None:
        bits.append(f"max abs {c['max_abs']:.3g}")
    if c.get("ulp") is not None:
        bits.append(f"{c['ulp']} ulp")
    if c.get("argmax_agree") is not None:
        bits.append(f"argmax agrees on {100 * c['argmax_agree']:.1f}% of rows")
    if c.get("topk_overlap") is not None:
        bits.append(f"top-k overlap {c['topk_overlap']:.2f}")
    if c.get("note"):
        bits.append(_e(c["note"]))
    verdict = c["verdict"]
    if bitwise and verdict == "within tolerance":
        # Under a bitwise diff, compare's own default tolerance is a hint, not the verdict.
        verdict = "bits differ, values within the default tolerance for the dtype"
    return f"{verdict}: " + ", ".join(bits)


def render_recording_diff(r: RecordingDiff) -> str:
    """Several parts: the overall verdict, then each part as ``render_diff`` shows it."""
    colour = {"the same": "green", "the same within tolerance": "yellow"}.get(str(r.verdict), "red")
    lines = [style(_e(r.headline), fg=colour, bold=True)]
    for w, names in (("A", r.only_a), ("B", r.only_b)):
        if names:
            lines.append(f"parts in {w} only, not compared: {_e(', '.join(names))}")
    for name, d in r.parts.items():
        lines += ["", f"== part {_e(name)} ==", render_diff(d)]
    return "\n".join(lines)


def render_diff(r: RunDiff) -> str:
    """One part against another: the verdict on the first line, then the evidence."""
    colour = {"the same": "green", "the same within tolerance": "yellow"}.get(str(r.verdict), "red")
    lines = [style(_e(r.headline), fg=colour, bold=True), f"A  {_e(r.a)}", f"B  {_e(r.b)}",
             f"compared {r.tolerance}; {_pairs(len(r.streams))}"]
    lines += [f"  {_e(n)}" for n in r.notes]
    lines += _stream_lines(r)
    lines += _unsharded_lines(r)
    lines += _batching_lines(r)
    lines.append("what else differs, most likely cause first:")
    lines.append(table(["", ""], [_context_row(c) for c in r.context]).split("\n", 1)[1])
    if r.next:
        lines.append(f"next: {_e(r.next)}   (the module that makes the difference)")
    return "\n".join(lines)


def _pairs(n: int) -> str:
    # A pair of ranks (rank r of A, rank r of B); "streams" in info are a rank's draft and target.
    return f"{n} rank pair{'s' if n != 1 else ''}"


def _stream_lines(r: RunDiff) -> list[str]:
    """The streams table (those that differ first), the first difference's figures, the fields
    that differ per stream, and each stream's other findings."""
    shown = sorted(r.streams, key=lambda s: (s.verdict.exit_code == 0, s.rank_a))[:_MAX_STREAM_ROWS]
    rows = [[s.name, str(s.verdict), _first_cell(s), _where(s.first_token) + (_margins(s.first_token) if s.first_token else ""),
             f"{s.differing_steps} of {s.facts.common.size}"] for s in sorted(shown, key=lambda s: s.rank_a)]
    lines = [table(["ranks", "verdict", "first difference", "first token divergence", "steps differ"], rows)]
    if len(r.streams) > len(shown):
        lines.append(f"  ... {_pairs(len(r.streams) - len(shown))} more, all the same (--json lists them)")
    if r.first is not None:
        s, f = r.first
        detail = _comparison_line(f, bitwise=r.tolerance == "bitwise")
        if detail:
            lines.append(f"at the first difference ({s.name}, {f.where}, {_e(f.field)}): {detail}")
    lines += _field_groups(r)
    for s in r.streams:
        if s.first_beyond_tolerance is not None:
            f = s.first_beyond_tolerance
            lines.append(f"{s.name}: first beyond tolerance at {f.where} {_e(f.field)}: {_comparison_line(f)}")
        lines += [f"{s.name}: {_e(reason)}" for reason in s.reasons]
    return lines


def _first_cell(s: Any) -> str:
    """Where a pair first differs; for a pair that differs in no field of their common steps
    (one run recorded more steps), why it is "different" instead of a bare "-"."""
    if s.first is None and s.verdict.exit_code != 0 and s.reasons:
        return _e(s.reasons[0])
    return _where(s.first)


def _field_groups(r: RunDiff) -> list[str]:
    """Streams that differ in the same fields at as many steps are one line (8 drifting ranks: one)."""
    groups: dict[str, list[str]] = {}
    for s in r.streams:
        if s.by_field:
            fields = ", ".join(f"{_e(k)} ({v} step{'s' if v != 1 else ''})" for k, v in s.by_field.items())
            groups.setdefault(fields, []).append(s.name)
    lines = []
    for fields, names in list(groups.items())[:_MAX_STREAM_ROWS]:
        ranks = all(n.startswith("rank ") for n in names)
        who = names[0] if len(names) == 1 else (
            "ranks " + ", ".join(n.removeprefix("rank ") for n in names) if ranks else "; ".join(names))
        lines.append(f"{who}: fields that differ: {fields}")
    return lines


def _unsharded_lines(r: RunDiff) -> list[str]:
    if not r.unsharded:
        return []
    lines = [f"compared unsharded (A has {r.layouts['a']} ranks, B {r.layouts['b']}):"]
    for u in r.unsharded:
        what = str(u.verdict)
        if u.compared_steps:
            what += f" at {u.compared_steps} step(s)"
        if u.first_step is not None:
            what += f", first at step {u.first_step}, {u.differing_steps} step(s) differ"
        lines.append(f"  {_e(u.field)}: {what}; A {_e(u.layout_a)}, B {_e(u.layout_b)}" + (f"; {_e(u.note)}" if u.note else ""))
    return lines


def _batching_lines(r: RunDiff) -> list[str]:
    bt = r.batching
    if bt is None:
        return []
    lines = [f"batched differently: {_e(bt.evidence)}"]
    if bt.aligned:
        fb = bt.first
        tail = (f"; first at request {_e(fb['request'])} position {_e(fb['position'])}: {_e(fb['field'])} "
                f"(A step {fb['step_a']}, B step {fb['step_b']})") if fb else ""
        lines.append(f"  aligned by request and position: {bt.rows_differ} of {bt.rows_compared} rows differ ({_e(', '.join(bt.fields))}){tail}")
    if bt.note:
        lines.append(f"  {_e(bt.note)}")
    return lines


def _context_row(c: Any) -> list[str]:
    """One row of what else differs: not compared (why), the same, or the first items that differ."""
    if not c.compared:
        return [c.category.value, _e(c.note)]
    note = f" ({_e(c.note)})" if c.note else ""
    if not c.differs:
        return [c.category.value, "the same" + note]
    shown = "; ".join(_item(i) for i in c.items[:3]) + (f"; ... {c.count - 3} more" if c.count > 3 else "")
    return [c.category.value, style(f"{c.count} differ: ", fg="red") + shown + note]


def _item(i: dict[str, Any]) -> str:
    where = ""
    if "rank_a" in i:
        where = f" [A r{i['rank_a']} / B r{i['rank_b']}]"
    elif "ranks_a" in i:
        ra = i["ranks_a"]
        where = f" [rank{'s' if len(ra) > 1 else ''} {', '.join(map(str, ra[:4]))}{', ...' if len(ra) > 4 else ''}]"
    at = f" kernel #{i['first_difference']}" if "first_difference" in i else ""
    if "steps" in i and "step" in i:  # a step argument: from which step, for how many
        at = f" (from step {i['step']}, {i['steps']} step{'s' if i['steps'] != 1 else ''})"
    return f"{_e(i['name'])}{at}: A {_e(i.get('a'))}, B {_e(i.get('b'))}{where}"
