"""``replay step``: re-run one step of one rank, eagerly, under a CUDA graph, or both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from replay.analysis.summary import choose_part
from replay.cli.common import (emit_json, json_option, open_run, parse_options, parse_ranks, part_option, program_output_to_stderr,
                               run_argument, save_and_emit)
from replay.cli.render import style, table
from replay.errors import ReplayError, RerunError, UsageError
from replay.format.reader import Part
from replay.textsafe import escape
from replay.rerun.result import ModeRun, StepRerun
from replay.rerun.result import NO_STATE_HINT, PARAMETERS_CHANGED_HINT
from replay.rerun.runner import KEYFRAME_EVERY_STEP_HINT, NO_KEYFRAME_NOTE, RerunOptions, caller_hint, default_modes
from replay.rerun.step import run_step, uses_relaunch

EPILOG = """\b
Examples:
  replay step --rank 3 --step 812 --mode both
  replay step RUN --rank 0 --step 40 --mode eager --device cpu --repeat 5
  replay step --rank 2 --step 57 --factory mypkg.engine:build --json
  replay step --ranks 0-3 --step 57 --devices cuda:0,cuda:1
"""


@click.command(epilog=EPILOG)
@run_argument
@part_option
@click.option("--rank", type=int, default=None, help="The rank to re-run (default: the only rank of a one-rank recording).")
@click.option("--ranks", "ranks_text", default=None, help="Several ranks (0-7 or 0,3): one process each.")
@click.option("--step", "step_index", type=int, required=True, help="The step to re-run.")
@click.option("--mode", type=click.Choice(["eager", "cudagraph", "compiled", "both"]), default=None,
              help="eager, cudagraph, compiled (torch.compile again, as recorded) or both (eager and cudagraph). "
                   "Default: what the recording and this machine can run (eager on a CPU; eager and cudagraph on a GPU).")
@click.option("--device", default=None, help="cpu or cuda:N (default: cuda:0 if the run was on a GPU and one is here).")
@click.option("--devices", default=None, help="With --ranks: devices to spread ranks over (cuda:0,cuda:1 or cpu).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Run the step N times from the same state.")
@click.option("--factory", default=None, metavar="MODULE:QUALNAME", help="Rebuild the target with this factory instead.")
@click.option("--stream", default=None, metavar="NAME",
              help="The model of the part to rebuild (draft, model, ...; default: the one that holds the step).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a target toggle (JSON value).")
@click.option("--no-save", is_flag=True, help="Do not save the result beside the recording.")
@click.option("--trust", is_flag=True,  # issue 16
              help="Import the code this recording names even though it is not your own signed recording (see docs/security.md).")
@json_option
def step(run: Path | None, root: str, part: str | None, rank: int | None, ranks_text: str | None, step_index: int,
         mode: str | None, device: str | None, devices: str | None, repeat: int, factory: str | None, stream: str | None,
         sets: tuple[str, ...], no_save: bool, as_json: bool, trust: bool = False) -> int:
    """Re-run step STEP of a rank of RUN (default: the newest recording) and compare it."""
    if rank is not None and ranks_text is not None:
        raise UsageError("give --rank R (one rank) or --ranks LIST (several), not both")
    options = parse_options(sets)
    modes = ["eager", "cudagraph"] if mode == "both" else [mode] if mode else None
    with open_run(run, root, quiet=as_json) as rec:
        chosen = choose_part(rec, part)
        if rank is None and ranks_text is None:
            if len(chosen) != 1:
                raise UsageError(f"give --rank R (one rank) or --ranks LIST (several): part {chosen.name} has ranks "
                                 f"{', '.join(map(str, chosen))}")
            rank = next(iter(chosen))  # a one-rank recording: that rank
        from replay.trust import admit_part  # issue 16: one line before anything is imported

        admit_part(chosen, factory=factory, trust=trust, recording=rec.path,
                   ranks=[rank] if rank is not None else parse_ranks(ranks_text or ""))
        if ranks_text is not None:
            return _step_ranks(rec.path, chosen, parse_ranks(ranks_text), step_index, modes, devices, repeat, factory,
                               options, as_json)
        assert rank is not None
        settings = RerunOptions(modes=tuple(modes or ()), device=device or "", repeat=repeat, factory=factory,
                                options=options, recording=str(rec.path), stream=stream)
        data, text, problem = _step_one(chosen, rank, step_index, settings, as_json)
    save_and_emit(rec.path, data, "" if as_json else text, save=not no_save, as_json=as_json)
    if problem is not None:
        # Never exit 0 for a step that could not be re-run or checked, or that raised: scripts
        # read the code.
        click.echo(f"replay: {escape(problem)}", err=True)
        return RerunError.exit_code
    return 0


def _step_one(chosen: Part, rank: int, step_index: int, settings: RerunOptions, as_json: bool) -> tuple[dict[str, Any], str, str | None]:
    """One rank: with its factory, or (none recorded) inside the re-launched program. (JSON, text, problem)."""
    announce = (lambda s: None) if as_json else (lambda s: click.echo(f"replay: {escape(s)}", err=True))
    try:
        from replay.cli.progress import progress
    except ImportError:  # pragma: no cover
        progress = lambda it, label="": it  # noqa: E731
    with program_output_to_stderr():
        result = run_step(chosen, rank, step_index, settings, announce=announce, progress=progress)
    data = result.to_json()
    for name, m in result.modes.items():
        mode = data.get("modes", {}).get(name)
        if isinstance(mode, dict):
            mode.setdefault("repeats_equal_by_output", _repeats_by_output(m))
    return data, render_step(result), result.exit_reason()


def _step_ranks(path: Path, chosen: Part, ranks: list[int], step_index: int, modes: list[str] | None, devices: str | None,
                repeat: int, factory: str | None, options: dict[str, Any], as_json: bool) -> int:
    """Several ranks, one process each; exits 7 when any of them could not be re-run."""
    from replay.rerun.multi import rerun_ranks

    if ranks and uses_relaunch(chosen, ranks[0], step_index, factory):
        # No factory: each rank in its own re-launched program, alone on its recorded collectives.
        results = []
        for r in ranks:
            settings = RerunOptions(modes=tuple(modes or ()), device=(devices or "").split(",")[0].strip(),
                                    repeat=repeat, options=options, recording=str(path))
            try:
                data, _, problem = _step_one(chosen, r, step_index, settings, True)
                results.append({**data, "collectives": "recorded"})
            except ReplayError as e:
                results.append({"rank": r, "step": step_index, "error": str(e)})
    else:
        if modes is None:
            first_dev = (devices or "cpu").split(",")[0].strip()
            modes = default_modes(chosen, ranks[0], step_index, first_dev) if ranks else ["eager"]
        with program_output_to_stderr():
            results = rerun_ranks(path, chosen.name, ranks, step_index, modes=modes, devices=devices,
                                  repeat=repeat, factory=factory, options=options)
    if as_json:
        emit_json({"kind": "step-ranks", "results": list(results)})
    else:
        click.echo(_ranks_headline(results, step_index))  # every command leads with its verdict
        for r in results:
            click.echo(render_step_json(r))
    failed = [r for r in results if r.get("error") or r.get("problem") or r.get("raised")]
    if failed:
        first = failed[0]
        why = first.get("error") or first.get("problem") or first.get("raised")
        click.echo(f"replay: rank {first.get('rank')}: {escape(why)}", err=True)
        return RerunError.exit_code
    return 0


def _ranks_headline(results: list[dict[str, Any]], step_index: int) -> str:
    """One verdict over several ranks: "reproduced" only when every rank's own verdict is."""
    def ranks(rs: list[dict[str, Any]]) -> str:
        return ", ".join(str(r.get("rank")) for r in rs)

    failed = [r for r in results if r.get("error") or r.get("problem") or r.get("raised")]
    done = [r for r in results if r not in failed]
    same = [r for r in done if str(r.get("headline") or "").startswith("reproduced:")]
    other = [r for r in done if r not in same]
    if results and len(same) == len(results):
        live = {r.get("collectives") for r in results} == {"live"}
        how = ("together, their collectives live between them" if live else
               "each alone against its own recording, its collectives answered from the recording")
        return f"reproduced: step {step_index} of rank(s) {ranks(same)}, {how}"
    parts = ([f"rank(s) {ranks(other)} not reproduced (or not compared)"] if other else []) + \
            ([f"rank(s) {ranks(failed)} not re-run"] if failed else []) + ([f"rank(s) {ranks(same)} reproduced"] if same else [])
    return f"not reproduced: step {step_index}: " + "; ".join(parts or ["no rank re-run"])


def _no_keyframe(r: StepRerun) -> bool:
    return NO_KEYFRAME_NOTE in r.notes


def render_step(r: StepRerun) -> str:
    stream = f", stream {escape(r.stream)}" if r.stream else ""
    verdict = r.headline()
    lines = [style(escape(verdict), fg="green" if verdict.startswith("reproduced") else "red"),
             f"rank {r.rank}, step {r.step} of {escape(r.recording)} (part {escape(r.part)}{stream}) on {r.device}, "
             + (f"from the program's own state at step {r.keyframe} (no keyframe restored)" if r.live_start
              else f"from step {r.keyframe} (no state keyframe recorded: a fresh target)" if _no_keyframe(r)
              else f"from the keyframe at step {r.keyframe}")]
    if r.weights is not None and (any(_departs(m) for m in r.modes.values()) or not r.weights.same):
        lines.append(style(f"  {escape(r.weights)}", fg=None if r.weights.same else "yellow"))
    for m in r.modes.values():
        lines += _mode_lines(r, m)
    lines += _verdict_table(r)
    lines += [f"  {c}" for c in r.comparisons]
    lines += [style(f"  {m.mode}: repeated runs of the same step from the same state gave different bits: "
                    "a nondeterministic kernel, or host code that reads something other than its inputs (a clock, a file, "
                    "an unseeded random source)", fg="red") for m in r.modes.values() if m.repeats_equal is False]
    lines += [f"  note: {escape(n)}" for n in r.notes]
    return "\n".join(lines)


def _departs(m: ModeRun) -> bool:
    return m.departed is not None or not m.reproduces()


def _mode_lines(r: StepRerun, m: ModeRun) -> list[str]:
    """What one mode's re-run did before the verdicts: catch-up, how it ran, context, errors."""
    lines = [_catch_up_line(r, m)] if m.caught_up else []
    if m.ran_as:
        lines.append(f"  {m.mode}: ran {escape(m.ran_as)}")
    if _departs(m) or m.context_differences:
        lines.append("  " + _context_line(m))
    lines += [style(f"  {m.mode}: {escape(c)}", fg="yellow") for c in m.collective_mismatches[:3]]
    if m.error or m.recorded_error:
        lines.append(_error_line(r, m))
    return lines


def _catch_up_line(r: StepRerun, m: ModeRun) -> str:
    """The catch-up steps: bit for bit only when every one of them was compared and matched."""
    n = len(m.caught_up)
    span = (f"steps {r.keyframe}..{r.step - 1}" if n == r.step - r.keyframe else
            f"{n} step{'s' if n > 1 else ''} of stream {escape(r.stream)} in {r.keyframe}..{r.step - 1} ({_steps(m.caught_up)})")
    if m.departed is not None:
        # The catch-up feeds recorded inputs to the rebuilt state; state the program changes
        # between steps (a beam search reordering its cache) is only seen at a keyframe.
        # A keyframe cannot restore an object recorded by class name only: no hint then.
        hint = (f"; {NO_STATE_HINT}" if r.no_keyframes else
                "; if the program changes the model's state between steps (a beam search reordering its cache, a "
                "reset), a keyframe every step restores it: replay record --keyframe-every 1"
                # The other remedy at once (not after a re-recording that could not help): state
                # outside the model, which no keyframe holds.
                + caller_hint(r.caller, r.loop)) if (
            r.keyframe < m.departed.step < r.step and not r.unrecorded and not r.state_outside) else ""
        if m.departed.step == r.keyframe > 0 and not r.live_start:
            # The first step after the restore: what the keyframe holds is the likeliest cause.
            hint = ("; that is the keyframe's own step: the keyframe may not hold all the state the step reads "
                    "(name all of it with replay record --state)")
        if r.parameters_changed:
            hint = f"; {PARAMETERS_CHANGED_HINT}"  # (a model other than the rebuilt one ran: no state restores that)
        return style(f"  {m.mode}: the re-run departed from the recording at {escape(m.departed)} (teacher-forced from there)"
                     + hint, fg="yellow")
    if not m.uncompared:
        return f"  {m.mode}: {span} re-ran bit for bit as recorded"
    return style(f"  {m.mode}: {span} re-ran; {n - len(m.uncompared)} of {n} matched their recorded outputs bit for bit, "
                 f"{len(m.uncompared)} had no recorded output to compare with (steps {_steps(m.uncompared)})", fg="yellow")


def _error_line(r: StepRerun, m: ModeRun) -> str:
    kind = (m.error or "").split(":")[0]
    if m.error and kind == (m.recorded_error or "").split(":")[0]:
        return style(f"  {m.mode}: step {r.step} raised {escape(kind)}, as it did when recorded: {escape(m.recorded_error)}", fg="yellow")
    what = f"raised {escape(m.error)}" if m.error else "completed"
    rec = f"raised {escape(m.recorded_error)}" if m.recorded_error else "completed"
    # Raised after a catch-up where it completed when recorded: what it read was not there,
    # most often state the loop changes between steps, which only a keyframe at the step holds.
    hint = f"; {PARAMETERS_CHANGED_HINT if r.parameters_changed else NO_STATE_HINT if r.no_keyframes else KEYFRAME_EVERY_STEP_HINT}" if (
        m.error and not m.recorded_error and m.caught_up and r.keyframe < r.step and not r.unrecorded
        and not r.state_outside) else ""
    hint += caller_hint(r.caller, r.loop) if m.error and not m.recorded_error and not r.state_outside else ""
    return style(f"  {m.mode}: step {r.step} {what}; when recorded it {rec}{hint}", fg="red")


def _verdict_table(r: StepRerun) -> list[str]:
    rows = []
    for m in r.modes.values():
        repeats = _repeats_by_output(m)
        for name, c in m.vs_recording.items():
            ranks = m.matches_ranks.get(name, [])
            verdict = style(c.verdict_text, fg="green" if c.equal else "red")
            same = (repeats or {}).get(name)
            rep = ("-" if repeats is None else "same bits" if same else
                   style("bits vary" if same is False else "some vary", fg="red"))  # None: which output is not known
            rows.append([m.mode, escape(name), verdict, ",".join(map(str, ranks)) or "none", rep, escape(m.graph) or "-"])
    if not rows:
        return []
    return [f"step {r.step} against the recording:",
            table(["mode", "output", f"vs rank {r.rank} recorded", "same bits as ranks", "repeats", "ran as"], rows)]


def _repeats_by_output(m: ModeRun) -> dict[str, bool | None] | None:
    """Per output, whether each of the mode's repeats gave the bits of its first run; None when
    the repeats were not compared. Without the repeats' digests (a re-run read back from JSON that
    lacks them), an output of a mode whose repeats varied is None: which one varied is not known."""
    if m.repeats_equal is None:
        return None
    if m.repeats_equal:
        return dict.fromkeys([*m.digests, *m.vs_recording], True)
    return {k: all(d.get(k) == m.digests[k] for d in m.repeat_digests) if m.repeat_digests and k in m.digests else None
            for k in [*m.digests, *m.vs_recording]}


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")


def _context_line(m: ModeRun) -> str:
    """Whether the numerics context (SDPA flags, TF32, ...) the step ran under was the recorded one."""
    if not m.context_recorded:
        return f"{m.mode}: numerics context: not in the recording, so not restored (grad, autocast, SDPA, TF32 ... as this process has them)"
    if not m.context_differences:
        return f"{m.mode}: numerics context: restored as recorded (no setting differs)"
    shown = "; ".join(escape(d) for d in m.context_differences[:6])
    more = f" (+{len(m.context_differences) - 6} more)" if len(m.context_differences) > 6 else ""
    return style(f"{m.mode}: numerics context differs from the recorded one: {shown}{more}", fg="yellow")


def render_step_json(d: dict[str, Any]) -> str:
    head = f"rank {d.get('rank')}: step {d.get('step')}"
    modes = d.get("modes", {})
    parts = []
    for name, m in modes.items():
        vs = m.get("vs_recording", {})
        parts.append(f"{name}: " + ", ".join(f"{k} {v.get('verdict')}" for k, v in vs.items()))
    return head + (" | " + " | ".join(parts) if parts else "") + (f" | error: {d['error']}" if d.get("error") else "")
