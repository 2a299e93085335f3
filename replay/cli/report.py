"""``replay report``: the recording's drift as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from replay import api
from replay.cli.common import emit_json, json_option, open_run, part_option, report_unreadable, run_argument
from replay.analysis.summary import verdict_line
from replay.textsafe import escape

EPILOG = """\b
Examples:
  replay report                                   newest recording -> <recording>/report.html
  replay report recordings/20261130-120000-test_mtp -o /tmp/drift.html
  replay report --json | jq .first_divergence
  replay report recordings/tonight --against recordings/last-night
"""


@click.command(epilog=EPILOG)
@run_argument
@click.option(
    "-o", "--output", type=click.Path(path_type=Path, dir_okay=False), default=None,
    help="Where to write the page (default: report.html inside the recording).",
)
@part_option
@click.option("--against", default=None, metavar="B",  # issue 17
              help="Add a diff section: this recording against run B (PATH, PATH:PART or PATH:PART/RANK).")
@json_option
def report(run: Path | None, root: str, output: Path | None, part: str | None, against: str | None, as_json: bool) -> int:
    """Write an HTML report of RUN (default: the newest recording) and print its path.

    The page shows where ranks first disagree, a ranks x steps agreement map, accepted tokens,
    logit margins, which graph each rank ran, differing tuner choices and kernels, and saved
    `replay step` / `replay bisect` results. It needs no network to open. With --json, the data
    the page was built from is printed instead of the path.
    """
    with open_run(run, root, quiet=as_json) as rec:
        result = api.make_report(rec, part, output=output, against=against)
    if as_json:
        emit_json(result.to_json())
    else:
        # The verdict first (issue 17): against B, the diff's; else where the ranks first disagree.
        # The page's path is the last line, for scripts.
        click.echo(escape(result.data.diff["headline"] if result.data.diff is not None else report_verdict(result.data.summary)))
        click.echo(escape(str(result.path)))
    return report_unreadable(result.data.part, result.data.summary.get("unreadable_ranks") or [])


def report_verdict(summary: dict[str, Any]) -> str:
    """What the page says first: the verdict ``replay info`` leads with, and that the page is written."""
    return verdict_line(summary) + "; report written"
