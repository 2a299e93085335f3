"""``replay seal``: seal the journals a crashed run left behind (``replay record`` does it itself)."""

from __future__ import annotations

from pathlib import Path

import click

from replay import api
from replay.cli.common import emit_json, json_option, run_argument
from replay.errors import RecordingDamaged
from replay.format.reader import Recording, resolve_recording
from replay.textsafe import escape


@click.command()
@run_argument
@json_option
def seal(run: Path | None, root: str, as_json: bool) -> int:
    """Seal every rank journal of RUN whose process has ended."""
    path, _ = resolve_recording(run, root)
    result = api.seal(path)
    unreadable = _unreadable(path, result)
    if unreadable and not (result.sealed or result.live):
        # Nothing to seal is no news of a directory that is not a recording, or whose rank files
        # are damaged (or newer): that is the answer, in the one line the other commands give it.
        raise unreadable[0][2]
    if as_json:
        data = result.to_json()
        if unreadable:
            data["unreadable_ranks"] = [{"part": part, "rank": rank, "problem": str(e)} for part, rank, e in unreadable]
        emit_json(data)
    else:
        click.echo(render_seal(result))
    if unreadable:
        # After what was sealed, one line: the first rank file that cannot be read, and how many more.
        part, rank, e = unreadable[0]
        where = "" if rank is None else f"{escape(part)} rank {rank}: "
        more = f" (and {len(unreadable) - 1} more rank file(s) that cannot be read)" if len(unreadable) > 1 else ""
        click.echo(f"replay: {where}{escape(e)}{more}", err=True)
    return max([result.exit_code, *(e.exit_code for _, _, e in unreadable)])


def _unreadable(path: Path, result: api.SealOutcome) -> list[tuple[str, int | None, RecordingDamaged]]:
    """(part, rank, why) of each rank file sealed before this seal that cannot be read, read as
    ``info`` reads it; ("", None, why) when ``path`` is not a recording at all."""
    just_sealed = {(part, r.rank) for part, r in result.sealed}
    try:
        rec = Recording(path)
    except RecordingDamaged as e:
        return [("", None, e)]
    out: list[tuple[str, int | None, RecordingDamaged]] = []
    with rec:
        for name, part in rec.items():
            for rank, rf in part.items():
                if not rf.sealed or (name, rank) in just_sealed:
                    continue  # a journal (live, or one that cannot be sealed, said above), or a file written just now
                try:
                    rf.tables
                except RecordingDamaged as e:
                    out.append((name, rank, e))
    return out


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
