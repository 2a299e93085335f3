"""``replay verify``: exit 0 only when the recording is intact; otherwise say what is damaged."""

from __future__ import annotations

from pathlib import Path

import click

from replay import api
from replay.cli.common import emit_json, json_option, open_run, run_argument
from replay.cli.render import style
from replay.states import CheckState
from replay.textsafe import escape

_COLOUR = {CheckState.INTACT: "green", CheckState.INCOMPLETE: "yellow", CheckState.DAMAGED: "red"}


@click.command(epilog="\b\nExamples:\n  replay verify\n  replay verify recordings/RUN --quick")
@run_argument
@click.option("--quick", is_flag=True, help="Check structure only; do not re-digest the payload.")
@json_option
def verify(run: Path | None, root: str, quick: bool, as_json: bool) -> int:
    """Check every rank file of RUN (default: the newest recording), bit for bit."""
    with open_run(run, root) as rec:
        result = api.verify(rec, payload=not quick)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(render_verify(result))
    return result.exit_code


def render_verify(result: api.VerifyResult) -> str:
    """The verdict first (intact, incomplete or damaged, and how much was checked), then each rank file."""
    lines = [style(_headline(result), fg=_COLOUR[result.state], bold=True)]
    lines += [style(f"note: {escape(n)}", fg="yellow") for n in result.notes]
    for c in result.checks:
        head = f"{escape(c.part)} rank {c.rank}: {c.steps} steps, {c.tensors_checked} tensors checked"
        if c.intact:
            lines.append(f"{head}: " + style("intact", fg="green") + "".join(f"; {escape(n)}" for n in c.notes))
        else:
            state = CheckState(c.state)
            lines.append(f"{head}: " + style(state.value.upper(), fg=_COLOUR[state], bold=True))
            lines += [f"  - {escape(p)}" for p in c.problems]
    return "\n".join(lines)


def _headline(result: api.VerifyResult) -> str:
    """``recording is damaged: 1 of 3 rank files (rank 2)``; ``recording is intact: 3 rank files, ...``."""
    checks = result.checks
    bad = [c for c in checks if not c.intact]
    if bad:
        ranks = ", ".join(f"{escape(c.part)} rank {c.rank}" for c in bad[:4]) + (", ..." if len(bad) > 4 else "")
        return f"{result}: {len(bad)} of {len(checks)} rank file{'s' if len(checks) != 1 else ''} ({ranks})"
    tensors = sum(c.tensors_checked for c in checks)
    how = f"{tensors} tensors re-digested" if tensors else "structure checked, payload not re-digested"
    return (f"{result}: {len(checks)} rank file{'s' if len(checks) != 1 else ''}, "
            f"{sum(c.steps for c in checks)} steps, {how}")
