"""The HTML report: a recording's drift as pictures (``replay report``).

``build_report`` gathers the data from the summary tables (no matplotlib needed; ``--json``
prints it), ``render_html`` turns it into one self-contained page, ``write_report`` writes that
page atomically::

    from replay.report import build_report, write_report
    path = write_report(build_report("recordings/20261130-120000-test_mtp"))
"""

from replay.report.data import Report, build_report, load_results
from replay.report.html import render_html, write_report

__all__ = ["Report", "build_report", "load_results", "render_html", "write_report"]
