"""``replay report``: the recording's drift as one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

import click

from replay.cli.common import emit_json, json_option, open_run, part_option, run_argument, unreadable_exit
from replay.report import build_report, write_report

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
        data = build_report(rec, part)
        if against is not None:  # issue 17
            from replay.analysis.diff import diff

            data.diff = diff(f"{rec.path}:{data.part}", against).to_json()
    path = write_report(data, output)
    if as_json:
        emit_json({"report": str(path), **data.to_json()})
    else:
        if data.diff is not None:  # issue 17: the verdict first
            from replay.textsafe import escape

            click.echo(escape(data.diff["headline"]))
        click.echo(str(path))
    return unreadable_exit(data.summary)
