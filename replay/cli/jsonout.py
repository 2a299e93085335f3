"""``--json`` answers on stdout: the one place that prints them, so an error after an answer
adds no second document. Kept free of heavy imports: ``replay.cli.main`` uses it for every error."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["begin_command", "emit_json", "emit_json_error"]

_emitted = False  # this process printed its --json answer (an error after it adds no second one)


def begin_command() -> None:
    """A new command in this process (tests call ``main`` many times): nothing printed yet."""
    global _emitted
    _emitted = False


def emit_json(obj: Any) -> None:
    global _emitted
    _emitted = True
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def emit_json_error(argv: list[str], message: str, code: int) -> None:
    """With ``--json`` (among replay's own arguments, not a recorded program's after ``--``), an
    error is JSON on stdout too: a script reading stdout gets an answer it can parse, not nothing."""
    own = argv[:argv.index("--")] if "--" in argv else argv
    if "--json" in own and not _emitted:
        emit_json({"kind": "error", "error": message, "exit_code": code})
