"""Options and helpers shared by the commands."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import click

from replay.cli.jsonout import emit_json
from replay.errors import RecordingDamaged, UsageError
from replay.format.reader import Recording, resolve_recording
from replay.states import RESULTS_FORMAT_VERSION
from replay.textsafe import escape

__all__ = ["run_argument", "json_option", "part_option", "open_run", "emit_json", "save_and_emit", "default_root",
           "parse_options", "parse_ranks", "report_unreadable", "split_list", "program_output_to_stderr"]

F = TypeVar("F", bound=Callable[..., Any])


def default_root() -> str:
    return os.environ.get("REPLAY_RECORDINGS", "recordings")


def run_argument(fn: F) -> F:
    fn = click.option(
        "--root",
        default=default_root,
        show_default="recordings (or $REPLAY_RECORDINGS)",
        help="Where to look for the newest recording when RUN is left out.",
    )(fn)
    return click.argument("run", required=False, type=click.Path(path_type=Path))(fn)  # type: ignore[return-value]


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")(fn)  # type: ignore[return-value]


def part_option(fn: F) -> F:
    return click.option(
        "--part", default=None, help="Which run of the recording (default: the only one, or the first that diverged)."
    )(fn)  # type: ignore[return-value]


@contextlib.contextmanager
def program_output_to_stderr() -> Iterator[None]:
    """While a re-run runs the recorded program's code in this process (a module imported for
    its step runs its top level; a step prints), what it prints goes to stderr: stdout carries
    the verdict first, and ``--json`` output a parser can read. Both ``sys.stdout`` and file
    descriptor 1 (C code and subprocesses write there)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed or odd stdout: nothing to keep apart
        pass
    saved: int | None = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        if saved is not None:
            os.close(saved)
        saved = None
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
        if saved is not None:
            try:
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
            os.dup2(saved, 1)
            os.close(saved)


def open_run(run: Path | None, root: str, *, quiet: bool = False) -> Recording:
    """Open RUN, or the newest recording under ROOT, saying which one was taken."""
    path, defaulted = resolve_recording(run, root)
    rec = Recording(path)
    if defaulted and not quiet:
        click.echo(f"replay: using the newest recording, {path}", err=True)
    return rec


def report_unreadable(part: str, bad: list[dict[str, Any]]) -> int:
    """After showing what could be read: 0, or (one line on stderr) the damaged-recording code
    when some rank files of the part shown could not be read."""
    if not bad:
        return 0
    ranks = ", ".join(str(u["rank"]) for u in bad)
    which = f"ranks {ranks} cannot be read and are" if len(bad) > 1 else f"rank {ranks} cannot be read and is"
    click.echo(f"replay: {escape(part)}: {which} left out; `replay verify` says more", err=True)
    return RecordingDamaged.exit_code


def parse_ranks(text: str) -> list[int]:
    """``0-3`` or ``0,2,5`` (or a mix) as a sorted list of ranks."""
    out: list[int] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        lo, sep, hi = piece.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise UsageError(f"--ranks {text!r}: use a list like 0-3 or 0,2,5") from None
    return sorted(set(out))


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``--set key=value`` items as a dict; a value is JSON when it parses as JSON, else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: use --set key=value")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def split_list(items: tuple[str, ...]) -> list[str]:
    """Comma-separated entries (repeatable option), splitting only outside brackets and quotes."""
    out: list[str] = []
    for text in items:
        depth, quote, cur = 0, "", ""
        for ch in text:
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "\"'":
                quote = ch
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append(cur.strip())
                cur = ""
                continue
            cur += ch
        out.append(cur.strip())
    return [x for x in out if x]


def save_and_emit(path: Path, data: dict[str, Any], text: str, *, save: bool, as_json: bool) -> None:
    """The end of `step` and `bisect`: keep the result beside the recording (unless told not to),
    then print it as JSON or as ``text``, naming where it was saved."""
    data.setdefault("format_version", RESULTS_FORMAT_VERSION)
    if save:
        from replay.format.results import save_result

        saved = save_result(path, data)
        if saved is not None:
            data["saved_to"] = str(saved)
    if as_json:
        emit_json(data)
        return
    click.echo(text)
    if data.get("saved_to"):
        click.echo(f"saved {escape(data['saved_to'])}", err=True)
