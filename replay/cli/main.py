"""Entry point: the command group, and the one place where errors become exit codes.

Commands live in their own modules (``replay.cli.<name>``) and are imported only when used, so
``replay info`` never imports what ``replay step`` needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any

import click

from replay._version import __version__
from replay.textsafe import escape
from replay.cli.jsonout import begin_command, emit_json_error
from replay.errors import ReplayError

__all__ = ["cli", "main"]

# Command name -> module defining a click command of the same name.
COMMANDS = {
    "record": "replay.cli.record",
    "info": "replay.cli.info",
    "step": "replay.cli.step",
    "bisect": "replay.cli.bisect",
    "report": "replay.cli.report",
    "verify": "replay.cli.verify",
    "seal": "replay.cli.seal",
    "diff": "replay.cli.diff",  # issue 17
}

EPILOG = """\b
Typical session:
  replay record -- pytest tests/test_mtp.py     record every rank, no code change
  replay info                                   newest recording: first divergence
  replay step --rank 3 --step 812 --mode both   re-run one step, eager and CUDA graph
  replay bisect layers --rank 3 --step 812 --between eager,cudagraph
"""


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [n for n, m in COMMANDS.items() if importlib.util.find_spec(m) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        mod = COMMANDS.get(name)
        if mod is None or importlib.util.find_spec(mod) is None:
            return None
        return getattr(importlib.import_module(mod), name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
# The version from replay/_version.py, not from package metadata: right in a checkout that is not pip-installed.
@click.version_option(__version__, prog_name="replay", message="%(prog)s %(version)s")
def cli() -> None:
    """Record and replay multi-GPU LLM inference, and find where ranks drift."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code (never raises, never prints a traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    begin_command()

    def fail(message: str, code: int) -> int:
        click.echo(f"replay: {message}", err=True)
        emit_json_error(args, message.removeprefix("error: "), code)
        return code

    try:
        rv: Any = cli.main(args=args, prog_name="replay", standalone_mode=False)
    except ReplayError as e:
        # Error messages may quote the recording (a part, a field, a factory, an exception text).
        return fail(f"error: {escape(e)}", e.exit_code)
    except click.exceptions.Abort:
        return fail("interrupted", 130)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.UsageError as e:
        # One line, as for every other error: what is wrong, and where the valid choices are.
        where = e.ctx.command_path if e.ctx is not None else "replay"
        return fail(f"error: {escape(_one_line(e.format_message()))} (see `{where} --help`)", e.exit_code)
    except click.ClickException as e:
        return fail(f"error: {escape(_one_line(e.format_message()))}", e.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:
        return 0
    except MemoryError:
        # issue 16: never an internal error. What ran out is this process's memory; a damaged or
        # hostile recording that claims more than it stores is refused before it gets here.
        return fail("error: out of memory (this command needs more memory than the process may use; "
                    "`replay verify` checks the recording's files)", 4)
    except OSError as e:
        # The file system said no (permissions, a full disk, a path that is not a directory):
        # the user's environment, not a bug, so one line that names the path.
        if os.environ.get("REPLAY_DEBUG"):
            traceback.print_exc()
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"error: {escape(where)}{escape(e.strerror or e)}", 74)  # EX_IOERR
    except Exception as e:  # noqa: BLE001 - the last line of defence against a traceback
        if os.environ.get("REPLAY_DEBUG"):
            traceback.print_exc()
        return fail(f"internal error: {e.__class__.__name__}: {escape(str(e).splitlines()[0]) if str(e) else ''} "
                    "(set REPLAY_DEBUG=1 for the traceback, and please report it)", 70)
    return rv if isinstance(rv, int) else 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
