"""``replay seal``: seal the journals a crashed run left behind (``replay record`` does it itself)."""

from __future__ import annotations

from pathlib import Path

import click

from replay.cli.common import emit_json, json_option, run_argument
from replay.format.reader import resolve_recording
from replay.format.seal import seal_part


@click.command()
@run_argument
@json_option
def seal(run: Path | None, root: str, as_json: bool) -> int:
    """Seal every rank journal of RUN whose process has ended."""
    path, _ = resolve_recording(run, root)
    results = []
    for part in sorted(p for p in path.iterdir() if p.is_dir()):
        for r in seal_part(part):
            results.append({"part": part.name, "rank": r.rank, "steps": r.steps, "complete": r.complete, "problem": r.problem})
    if as_json:
        emit_json({"recording": str(path), "sealed": results})
    else:
        for r in results:
            click.echo(f"{r['part']} rank {r['rank']}: sealed {r['steps']} steps" + ("" if r["complete"] else " (ended early)"))
        if not results:
            click.echo("nothing to seal")
    return 0
