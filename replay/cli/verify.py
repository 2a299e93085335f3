"""``replay verify``: exit 0 only when the recording is intact; otherwise say what is damaged."""

from __future__ import annotations

from pathlib import Path

import click

from replay.analysis.verify import verify_recording
from replay.cli.common import emit_json, json_option, open_run, run_argument
from replay.cli.render import style


@click.command(epilog="\b\nExamples:\n  replay verify\n  replay verify recordings/RUN --quick")
@run_argument
@click.option("--quick", is_flag=True, help="Check structure only; do not re-digest the payload.")
@json_option
def verify(run: Path | None, root: str, quick: bool, as_json: bool) -> int:
    """Check every rank file of RUN (default: the newest recording), bit for bit."""
    with open_run(run, root) as rec:
        checks = verify_recording(rec, payload=not quick)
        path = str(rec.path)
    intact = all(c.intact for c in checks)
    state = "intact" if intact else ("incomplete" if all(c.state != "damaged" for c in checks) else "damaged")
    if as_json:
        emit_json({"recording": path, "intact": intact, "state": state, "ranks": [c.to_json() for c in checks]})
    else:
        for c in checks:
            head = f"{c.part} rank {c.rank}: {c.steps} steps, {c.tensors_checked} tensors checked"
            if c.intact:
                click.echo(f"{head}: " + style("intact", fg="green") + "".join(f"; {n}" for n in c.notes))
            else:
                click.echo(f"{head}: " + style(c.state.upper(), fg="red" if c.state == "damaged" else "yellow", bold=True))
                for p in c.problems:
                    click.echo(f"  - {p}")
        if intact:
            click.echo(style("recording is intact", fg="green"))
        elif state == "incomplete":
            click.echo(style("recording is incomplete: what it holds is whole, the end of the run is missing", fg="yellow"))
        else:
            click.echo(style("recording is damaged", fg="red"))
    return 0 if intact else 4
