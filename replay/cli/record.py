"""``replay record -- CMD``: record every rank of CMD, with no change to its code."""

from __future__ import annotations

import os
from pathlib import Path

import click

from replay import api
from replay.cli.common import default_root, emit_json
from replay.cli.info_text import render_info
from replay.errors import ReplayError, UsageError
from replay.format.reader import Recording
from replay.record.discovery import NOTHING_RAN, read_reports, summary_lines
from replay.record.config import RecordConfig
from replay.record.settings import load_pyproject_settings
from replay.textsafe import escape
from replay.record.wrapper import record_command, recording_dir_for

EPILOG = """\b
Examples:
  replay record -- pytest tests/test_mtp.py
  replay record --step mypkg.engine:Engine.step --state state_tensors -- python serve.py
  replay record --out /shared/rec -- torchrun --nnodes 2 --node-rank 0 ... run.py
Settings can also live in [tool.replay] of pyproject.toml (same names, e.g. steps = [...]).
"""


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}, epilog=EPILOG)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Recording directory (default: recordings/<time>-<name>).")
@click.option("--name", default=None, help="Name part of the default directory.")
@click.option("--step", "steps", multiple=True, metavar="MODULE:QUALNAME", help="A callable whose calls are steps (repeatable).")
@click.option("--profile", default=None, help="Built-in profile: mtp, auto (default: every profile, by import), none.")
@click.option("--state", default=None, help="Attribute/method of the step's object returning {name: tensor} state, or one tensor (kept under its name).")
@click.option("--config", "config_attr", default=None, help="Attribute/method returning the JSON config the factory takes.")
@click.option("--factory", default=None, metavar="MODULE:QUALNAME", help="Rebuilds the target for re-runs.")
@click.option("--tuner", default=None, help="Attribute/method returning {op: tactic} tuner choices.")
@click.option("--modules", default=None, help="Attribute holding the nn.Module (for per-layer bisection).")
@click.option("--graph-capture", multiple=True, metavar="MODULE:QUALNAME", help="A custom graph-capture callable.")
@click.option("--graph-replay", multiple=True, metavar="MODULE:QUALNAME", help="A custom graph-replay callable.")
@click.option("--probe", "probes", multiple=True, metavar="MODULE:QUALNAME", help="A callable inside the step whose outputs are recorded too.")
@click.option("--output-name", "outputs", multiple=True,
              help="Names for the values a step returns, in order (repeat the option, or separate them with commas).")
@click.option("--keyframe-every", type=click.IntRange(min=0), default=None, help="State keyframe every K steps [50].")
@click.option("--ring", type=click.IntRange(min=0), default=None, help="Keep full logits of the last N steps [16].")
@click.option("--collectives", type=click.Choice(["digest", "auto", "full"]), default=None,
              help="Collective outputs: digests, in full, or auto (in full up to 1 MiB each) [auto].")
@click.option("--durability", type=click.Choice(["step", "async"]), default=None, help="step: no completed step lost on SIGKILL.")
@click.option("--record-ring-mib", type=click.IntRange(min=0), default=None,
              help="Size of each rank's record ring in /dev/shm, MiB; 0: no ring [64].")
@click.option("--ring-full", type=click.Choice(["block", "drop"]), default=None,
              help="A full record ring: block (wait at the step boundary) or drop (record a gap) [block].")
@click.option("--drain", type=click.Choice(["process", "thread"]), default=None,
              help="Who moves the record ring to the journal: a process of each rank's own, or a thread of the program [process].")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None, help="Stop recording a rank past this many bytes.")
@click.option("--check-lockstep", is_flag=True, default=None, help="Compare output digests across ranks every step.")
@click.option("--stop-on-divergence", is_flag=True, default=None, help="With --check-lockstep: stop at the first mismatch.")
@click.option("--node-rank", type=int, default=None, help="This node's rank, for multi-node runs sharing --out.")
@click.option("--grace", type=float, default=30.0, show_default=True, help="Seconds to wait for ranks that outlive CMD.")
@click.option("--add", is_flag=True, help="Add to the recording already in --out (refused otherwise).")  # issue 16
@click.option("--run-anyway", is_flag=True,  # issue 16
              help="Run CMD even when nothing can be recorded (the recording directory cannot be written).")
@click.option("--permissions", type=click.Choice(["private", "group", "world"]), default=None,  # issue 16
              help="Who may read the recording: private (0600/0700, the default), group, world. [tool.replay] permissions.")
@click.option("--quiet", is_flag=True, help="Do not print the summary at the end (a run that recorded nothing still says so, and why).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout at the end.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def record(out, name, steps, profile, state, config_attr, factory, tuner, modules, graph_capture, graph_replay, probes, outputs,
           keyframe_every, ring, collectives, durability, record_ring_mib, ring_full, drain, max_bytes, check_lockstep, stop_on_divergence,
           node_rank, grace, quiet, as_json, cmd, add=False, run_anyway=False, permissions=None) -> int:
    """Run CMD (after --) and record every rank of every Python process it starts."""
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no command to record: replay record -- CMD ...")
    _set_permissions(permissions)
    settings = _settings(
        steps=list(steps), profile=profile, state=state, config=config_attr, factory=factory, tuner=tuner,
        modules=modules, graph_capture=list(graph_capture), graph_replay=list(graph_replay), probes=list(probes), output_names=[n.strip() for o in outputs for n in o.split(",") if n.strip()],
        keyframe_every=keyframe_every, ring=ring, collectives=collectives, durability=durability,
        record_ring_mib=record_ring_mib, ring_full=ring_full, drain=drain, max_bytes=max_bytes, check_lockstep=check_lockstep,
        stop_on_divergence=stop_on_divergence,
    )
    if node_rank is None:
        node_rank = api.detect_node_rank(cmd)
    path = _recording_dir(cmd, out, name, node_rank, add)
    if isinstance(path, str):
        return _unrecordable(cmd, path, run_anyway)
    try:
        result = record_command(cmd, settings, out=path, node=node_rank, grace_s=grace)
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}") from None
    except UsageError as e:
        if "cannot write the recording" not in str(e):
            raise
        return _unrecordable(cmd, str(e).split(": choose")[0], run_anyway)
    _report(path, result, quiet=quiet, as_json=as_json)
    return result.exit_code


def _set_permissions(permissions: str | None) -> None:
    """issue 16: recordings are owner-only unless widened; the mode goes to every rank through
    the environment (replay/format/perms.py), and the program's umask is left alone."""
    from replay.format import perms as _perms

    try:
        mode = _perms.Permissions.parse(permissions or _pyproject_permissions() or os.environ.get(_perms.ENV_PERMISSIONS, "private"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    os.environ[_perms.ENV_PERMISSIONS] = mode.value


def _settings(**given: object) -> RecordConfig:
    """[tool.replay] of the nearest pyproject.toml, then the command line; one line on a bad value."""
    try:
        table = load_pyproject_settings(Path.cwd())
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        base = RecordConfig(**table)
    except (TypeError, ValueError) as e:
        raise UsageError(f"[tool.replay] of the nearest pyproject.toml: {e}") from None
    try:
        return base.merged(**given)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _recording_dir(cmd: list[str], out: Path | None, name: str | None, node_rank: int | None, add: bool) -> Path | str:
    """The directory to record into, or why nothing can be recorded (a string).

    issue 16: an --out holding a recording is refused (unless --add, or another node of the same
    multi-node run); when nothing can be recorded, --run-anyway decides whether CMD runs."""
    from replay.format import perms as _perms
    from replay.format.manifest import claim_recording

    try:
        if out is None:
            return recording_dir_for(cmd, Path(default_root()), name)
        fresh = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        if fresh:
            os.chmod(out, _perms.dir_mode())
        refused = claim_recording(out, node_rank, add=add)
    except OSError as e:
        where = out if out is not None else Path(default_root())
        return f"cannot write the recording to {where} ({e.strerror or e})"
    if refused is not None:
        raise UsageError(f"{refused}: give a new --out, or --add to add to it")
    return out


def _report(path: Path, result: object, *, quiet: bool, as_json: bool) -> None:
    """What was recorded: the summary of ``replay info`` and each rank's steps."""
    summary = None
    nothing = None
    try:
        with Recording(path) as rec:
            summary = api.info(rec).to_json()
    except ReplayError as e:
        nothing = str(e)
    # Steps the recording holds: a process that ended through os._exit (a forked child does)
    # wrote no report, and the summary must not say its step never ran.
    held = sum(int(r.get("steps") or 0) for r in (summary or {}).get("ranks") or [])
    steps = summary_lines(read_reports(path), recorded_steps=held)
    if result.signal is not None or result.exit_code in (130, 137, 143):
        # Interrupted or killed before any model ran: the step was not missing, only not reached.
        steps = [f"replay: no step ran before the command was interrupted or killed (exit code {result.exit_code}): nothing "
                 "was there to find yet" if line == NOTHING_RAN else line for line in steps]
    if as_json:
        emit_json({"recording": str(path), "exit_code": result.exit_code, "signal": result.signal,
                   "still_live": result.still_live, "info": summary, "steps": steps, "nothing_recorded": nothing})
        return
    if quiet and summary is not None:
        _say_still_live(result.still_live)
        return
    # Even with --quiet: a run that recorded nothing says so, and why (a script must not take an
    # empty directory for a recording).
    if summary is not None:
        click.echo(f"\nreplay: recorded {escape(str(path))} (command exit code {result.exit_code})", err=True)
    else:
        # One line, not "recorded nothing" followed by "recorded DIR".
        click.echo(f"\nreplay: {escape(nothing or f'nothing was recorded in {path}')}", err=True)
    for line in steps:
        click.echo(line, err=True)
    if summary is not None:
        click.echo(render_info(summary), err=True)
    _say_still_live(result.still_live)


def _say_still_live(files: list[str]) -> None:
    for j in files:
        click.echo(f"replay: {j} is still being written by a running process; seal it later with `replay seal`", err=True)


def _pyproject_permissions() -> str | None:
    """issue 16: ``permissions`` under [tool.replay] of the user's pyproject.toml."""
    import tomllib

    for d in [Path.cwd(), *Path.cwd().parents]:
        p = d / "pyproject.toml"
        if p.is_file():
            try:
                v = tomllib.loads(p.read_text()).get("tool", {}).get("replay", {}).get("permissions")
            except (OSError, ValueError) as e:
                raise UsageError(f"{p}: cannot read [tool.replay] ({e})") from None
            return v if isinstance(v, str) else None
    return None


def _unrecordable(cmd: list[str], why: str, run_anyway: bool) -> int:
    """issue 16: nothing can be recorded. CMD runs unrecorded only if the user said so, and the
    one line says which happened."""
    import subprocess

    if not run_anyway:
        raise UsageError(f"{why}: {cmd[0]} was not run; choose a writable directory with --out, "
                         "or pass --run-anyway to run it unrecorded")
    click.echo(f"replay: {why}: running {cmd[0]} unrecorded (--run-anyway)", err=True)
    try:
        rc = subprocess.call(cmd)
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}") from None
    return rc if rc >= 0 else 128 - rc
