"""``replay seal``: seal the journals a crashed run left behind (``replay record`` does it itself)."""

from __future__ import annotations

from pathlib import Path

import click

from replay import api
from replay.cli.common import emit_json, json_option, run_argument
from replay.format.reader import resolve_recording
from replay.textsafe import escape


@click.command()
@run_argument
@json_option
def seal(run: Path | None, root: str, as_json: bool) -> int:
    """Seal every rank journal of RUN whose process has ended."""
    path, _ = resolve_recording(run, root)
    result = api.seal(path)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(render_seal(result))
    return result.exit_code


def render_seal(result: api.SealOutcome) -> str:
    """The verdict first (sealed, nothing to seal, or what could not be sealed), then each journal."""
    lines = [_headline(result)]
    for part, r in result.sealed:
        if r.error:
            lines.append(f"{escape(part)} rank {r.rank}: cannot be sealed ({escape(r.error)}); its journal is kept and readable")
        else:
            lines.append(f"{escape(part)} rank {r.rank}: sealed {r.steps} steps" + ("" if r.complete else " (ended early)"))
    for part, journal in result.live:
        lines.append(f"{escape(part)} {escape(journal)}: still being written by a running process; not sealed")
    return "\n".join(lines)


def _headline(result: api.SealOutcome) -> str:
    where = escape(result.recording)
    failed = [r for _, r in result.sealed if r.error]
    done = [r for _, r in result.sealed if not r.error]
    live = f"; {len(result.live)} still being written, not sealed" if result.live else ""
    if not result.sealed:
        if result.live:
            return f"nothing sealed in {where}: {len(result.live)} journal(s) still being written by a running process"
        return f"nothing to seal in {where}: no journal is left (every rank file is sealed)"
    early = sum(1 for r in done if not r.complete)
    text = f"sealed {len(done)} journal(s) in {where}" + (f" ({early} ended early)" if early else "")
    if failed:
        text = f"{len(failed)} of {len(result.sealed)} journal(s) cannot be sealed in {where}" + (f"; {text}" if done else "")
    return text + live
