"""``replay info``: what a recording holds and where its ranks first disagree."""

from __future__ import annotations

from pathlib import Path

import click

from replay import api
from replay.cli.common import emit_json, json_option, open_run, part_option, report_unreadable, run_argument
from replay.cli.info_text import render_info

__all__ = ["info"]


@click.command(epilog="\b\nExamples:\n  replay info\n  replay info recordings/20261130-120000-test_mtp --json")
@run_argument
@part_option
@json_option
def info(run: Path | None, root: str, part: str | None, as_json: bool) -> int:
    """Summarise RUN (default: the newest recording): ranks, steps, graphs, first divergence."""
    with open_run(run, root) as rec:
        result = api.info(rec, part)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(render_info(result))
    return report_unreadable(result.part, result.unreadable_ranks)


