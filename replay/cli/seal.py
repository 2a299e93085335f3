"""``replay seal``: seal the journals a crashed run left behind (``replay record`` does it itself)."""

from __future__ import annotations

from pathlib import Path

import click

from replay.cli.common import emit_json, json_option, run_argument
from replay.errors import RecordingDamaged
from replay.format.reader import resolve_recording
from replay.format.seal import journal_is_live, seal_part


@click.command()
@run_argument
@json_option
def seal(run: Path | None, root: str, as_json: bool) -> int:
    """Seal every rank journal of RUN whose process has ended."""
    path, _ = resolve_recording(run, root)
    if not path.is_dir():
        raise RecordingDamaged(f"{path} is a file, not a recording: give the directory `replay record` wrote")
    results = []
    from replay.trust import seal_sign_after  # issue 16: sign only what this user's `replay record` started

    sign_after = seal_sign_after(path)
    for part in sorted(p for p in path.iterdir() if p.is_dir()):
        for r in seal_part(part, sign_after=sign_after):  # issue 16
            results.append({"part": part.name, "rank": r.rank, "steps": r.steps, "complete": r.complete,
                            "problem": r.problem, "error": r.error})
        live = sorted(j.name for j in part.glob("rank-*.journal") if journal_is_live(j))
        results += [{"part": part.name, "journal": name, "live": True} for name in live]
    failed = [r for r in results if r.get("error")]
    if as_json:
        emit_json({"recording": str(path), "sealed": results})
    else:
        for r in results:
            if r.get("live"):
                click.echo(f"{r['part']} {r['journal']}: still being written by a running process; not sealed")
            elif r["error"]:
                click.echo(f"{r['part']} rank {r['rank']}: cannot be sealed ({r['error']}); its journal is kept and readable")
            else:
                click.echo(f"{r['part']} rank {r['rank']}: sealed {r['steps']} steps" + ("" if r["complete"] else " (ended early)"))
        if not results:
            click.echo("nothing to seal")
    return 4 if failed else 0
