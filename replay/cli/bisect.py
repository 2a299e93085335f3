"""``replay bisect steps|layers|config``: the first step, the first layer, or the smallest setting
where a step diverges.

The old one-command forms (``replay bisect --steps``, ``--between A,B``, ``--config``), used in
scripts and older docs, still work: they are read as the sub-command they name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from replay import api
from replay.bisect.config_model import CRITERIA, ConfigBisection, ConfigBisectSettings
from replay.bisect.layers import LayersBisection, ModuleVerdict
from replay.bisect.steps import StepsBisection
from replay.cli.common import (json_option, open_run, parse_options, parse_ranks, part_option, program_output_to_stderr,
                               run_argument, save_and_emit, split_list)
from replay.cli.progress import progress
from replay.analysis.compare import Verdict
from replay.cli.render import fmt_verdict, style, table
from replay.errors import RerunError, UsageError  # RerunError: exit code of a bisection that compared nothing
from replay.format.reader import Part
from replay.states import BisectStatus, StepsHow
from replay.textsafe import escape

__all__ = ["bisect"]

EPILOG = """\b
Examples:
  replay bisect steps                                      first step where the ranks disagree (by majority)
  replay bisect steps --ranks 0,3                          ... where ranks 0 and 3 disagree
  replay bisect steps --against-rerun --rank 3             first step whose re-run departs from the recording
  replay bisect layers --rank 3 --step 812 --between eager,cudagraph     first module that differs
  replay bisect layers --step 812 --between rank:0,rank:3 --modules 'layers.*'
  replay bisect layers --rank 3 --step 812 --between recorded,rerun
  replay bisect layers --between run:recA,run:recB:run-000/3  two runs: the module that makes the difference
  replay bisect config --rank 3 --step 812 --toggles deterministic,tuner,cudagraph
  replay bisect config --rank 0 --step 5 --criterion reproduce   what makes the re-run match the recording
  replay bisect config --rank 3 --step 812 --criterion live     all ranks at once, live collectives
"""

# The flag of the old one-command form -> the sub-command it names (the flag is dropped, except
# --between, which layers takes as its own option).
_LEGACY = {"--steps": "steps", "--between": "layers", "--config": "config"}


def _legacy_command(args: list[str]) -> list[str]:
    """``[RUN] --steps ...`` -> ``steps [RUN] ...``; the same for ``--between`` and ``--config``."""
    named = [(i, a) for i, a in enumerate(args) if a.split("=", 1)[0] in _LEGACY]
    flags = list(dict.fromkeys(a.split("=", 1)[0] for _, a in named))
    if not flags and ("--help" in args or "-h" in args):
        return ["--help"]
    if not flags:
        raise UsageError("say what to bisect: replay bisect steps, replay bisect layers --between A,B or replay bisect config")
    if len(flags) > 1:
        raise UsageError(f"{' and '.join(flags)} cannot be combined: run one bisection at a time")
    flag = flags[0]
    rest = [a for a in args if a != flag] if flag != "--between" else list(args)
    return [_LEGACY[flag], *rest]


class _BisectGroup(click.Group):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = _legacy_command(args)
        return super().parse_args(ctx, args)


@click.group(cls=_BisectGroup, epilog=EPILOG)
def bisect() -> None:
    """Bisect a recording (default: the newest) across steps, layers or settings."""


# -- options shared by the sub-commands -----------------------------------------------------


def _rerun_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed([
        click.option("--device", default=None, help="cpu or cuda:N (default: cuda:0 if the run was on a GPU and one is here)."),
        click.option("--factory", default=None, metavar="MODULE:QUALNAME", help="Rebuild the target with this factory instead."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a target toggle in every re-run (JSON value)."),
        click.option("--no-save", is_flag=True, help="Do not save the result beside the recording."),
        click.option("--trust", is_flag=True,  # issue 16
                     help="Import the code this recording names even though it is not your own signed recording "
                          "(see docs/security.md)."),
        json_option,
    ]):
        fn = opt(fn)
    return fn


def _say(as_json: bool) -> Callable[[str], None]:
    if as_json:
        return lambda s: None
    return lambda s: click.echo(f"replay: {escape(s)}", err=True) if s else None


def _finish(rec_path: Path, result: StepsBisection | LayersBisection | ConfigBisection, *, save: bool, as_json: bool) -> int:
    save_and_emit(rec_path, result.to_json(), "" if as_json else render(result), save=save, as_json=as_json)
    # [foreign: truthful verdicts] a layer bisection whose step raised, or that compared nothing, is not a result.
    problem = result.problem() if isinstance(result, (LayersBisection, StepsBisection)) else None
    if problem is not None:
        click.echo(f"replay: {escape(problem)}", err=True)
        return RerunError.exit_code
    return 0


def _part(run: Path | None, root: str, part: str | None, as_json: bool) -> tuple[Any, Part]:
    rec = open_run(run, root, quiet=as_json)
    return rec, api.choose_part(rec, part)


def _admit(p: Part, *, factory: str | None, trust: bool, say: Callable[[str], None]) -> None:
    """Issue 16: a re-run imports code the recording names; say what, before it does (and refuse
    a recording that is not the user's own unless ``--trust``)."""
    from replay.trust import admit_part

    imports = admit_part(p, factory=factory, trust=trust, recording=p.path.parent)
    # Not importable from here: a recording with no factory is re-run inside the re-launched
    # program, which imports its own code from where it ran.
    imports = [i.replace(" (from not found)", " (imported by the re-launched program)") for i in imports]
    if imports:
        say(f"importing {', '.join(imports[:3])}{' and more' if len(imports) > 3 else ''} (named by the recording)")


# -- sub-commands ---------------------------------------------------------------------------


@bisect.command(epilog="\b\nExamples:\n  replay bisect steps\n  replay bisect steps --ranks 0,3\n"
                       "  replay bisect steps --against-rerun --rank 3 --mode cudagraph")
@run_argument
@part_option
@click.option("--ranks", "ranks_text", default=None, help="The ranks to compare (0,3 or 0-7; default all, by majority).")
@click.option("--against-rerun", is_flag=True, help="Compare the recording of --rank with re-runs of it.")
@click.option("--exhaustive", is_flag=True, help="With --against-rerun: re-run every keyframe interval in order, not a binary search.")
@click.option("--rank", type=int, default=None, help="With --against-rerun: the rank to re-run (default: the odd one at the first divergence).")
@click.option("--mode", type=click.Choice(["eager", "cudagraph"]), default="eager", show_default=True, help="With --against-rerun: how to re-run.")
@click.option("--stream", default=None, metavar="NAME", help="Several models in one loop: bisect this one's steps only (replay info lists them).")
@_rerun_options
def steps(run: Path | None, root: str, part: str | None, ranks_text: str | None, against_rerun: bool, exhaustive: bool,
          rank: int | None, mode: str, stream: str | None, device: str | None, factory: str | None, sets: tuple[str, ...],
          no_save: bool, trust: bool, as_json: bool) -> int:
    """The first step where the ranks disagree, or where a re-run departs from the recording."""
    if ranks_text and against_rerun:
        raise UsageError("--ranks compares recorded ranks, --against-rerun compares one rank with re-runs: pick one")
    options = api.RerunOptions(modes=(mode,), device=device, factory=factory, toggles=parse_options(sets))
    rec, p = _part(run, root, part, as_json)
    with rec, program_output_to_stderr():  # the program's prints: not into the verdict or --json
        if against_rerun:
            _admit(p, factory=factory, trust=trust, say=_say(as_json))
            result = api.bisect_steps_rerun(p, rank, options, exhaustive=exhaustive, stream=stream, announce=_say(as_json),
                                            progress=progress)
        else:
            chosen = parse_ranks(ranks_text) if ranks_text else None
            _check_readable(p, chosen)
            result = api.bisect_steps(p, ranks=chosen, stream=stream)
    return _finish(rec.path, result, save=not no_save, as_json=as_json)


def _check_readable(p: Part, ranks: list[int] | None) -> None:
    """The rank files to compare can be read: a damaged one, or a file that is no recording, is
    said as the other commands say it (exit 4), not as a part with too few ranks to compare."""
    for r in ranks if ranks is not None else list(p):
        if r in p:
            p[r].tables


@bisect.command(epilog="\b\nExamples:\n  replay bisect layers --rank 3 --step 812 --between eager,cudagraph\n"
                       "  replay bisect layers --between rank:0,rank:3 --modules 'layers.*'\n"
                       "  replay bisect layers --rank 3 --step 812 --between recorded,rerun\n"
                       "  replay bisect layers --between run:recA,run:recB:run-000/3   two runs, module by module")
@run_argument
@part_option
@click.option("--between", required=True, metavar="A,B",
              help="The two executions: eager,cudagraph | rank:0,rank:3 | recorded,rerun | run:PATH_A,run:PATH_B "
                   "(two recordings; PATH[:PART[/RANK]] as replay diff takes them; run:PATH_B alone: RUN against it).")
@click.option("--rank", type=int, default=None, help="The rank to re-run (for eager, cudagraph, recorded, rerun).")
@click.option("--step", "step_index", type=int, default=None, help="The step (default, between two ranks: where they first disagree).")
@click.option("--modules", "modules_text", multiple=True, metavar="PATTERN", help="Tap only modules matching these globs (comma-separated).")
@click.option("--context", type=click.IntRange(min=0), default=3, show_default=True, help="Modules shown before the first that differs.")
@click.option("--mode", type=click.Choice(["eager", "cudagraph"]), default=None, help="Mode of executions that name none (default eager).")
@_rerun_options
def layers(run: Path | None, root: str, part: str | None, between: str, rank: int | None, step_index: int | None,
           modules_text: tuple[str, ...], context: int, mode: str | None, device: str | None, factory: str | None,
           sets: tuple[str, ...], no_save: bool, trust: bool, as_json: bool) -> int:
    """The first module whose output differs between two executions of a step, or two runs."""
    options = api.RerunOptions(device=device, factory=factory, toggles=parse_options(sets))
    runs = _run_specs(between)
    if runs:
        return _layers_between_runs(run, root, part, runs, rank=rank, step=step_index, mode=mode, options=options,
                                    modules=split_list(modules_text) or None, context=context, trust=trust,
                                    save=not no_save, as_json=as_json)
    rec, p = _part(run, root, part, as_json)
    with rec, program_output_to_stderr():  # the program's prints: not into the verdict or --json
        _admit(p, factory=factory, trust=trust, say=_say(as_json))
        result = api.bisect_layers(p, between, step=step_index, rank=rank, mode=mode, options=options,
                                   modules=split_list(modules_text) or None, context=context, announce=_say(as_json),
                                   progress=progress)
    return _finish(rec.path, result, save=not no_save, as_json=as_json)


def _run_specs(between: str) -> list[str]:
    """``run:A,run:B`` (or ``run:B`` alone) as the recording specs; [] when ``between`` names no run."""
    items = [x.strip() for x in between.split(",") if x.strip()]
    runs = [x for x in items if x.startswith("run:")]
    if not runs:
        return []
    if len(runs) != len(items) or len(items) > 2 or not all(x[4:] for x in runs):
        raise UsageError(f"--between {between}: two runs are run:PATH_A,run:PATH_B (or run:PATH_B, against RUN); "
                         "run: cannot be mixed with eager, cudagraph, rank:N, recorded or rerun")
    return [x[4:] for x in runs]


def _layers_between_runs(run: Path | None, root: str, part: str | None, runs: list[str], *, rank: int | None,
                         step: int | None, mode: str | None, options: api.RerunOptions, modules: list[str] | None,
                         context: int, trust: bool, save: bool, as_json: bool) -> int:
    """``--between run:A,run:B``: rank R of each run's part (R from PATH:PART/R, else --rank, else
    the first), re-run each from its own recording."""
    from replay.analysis.diff_sides import open_side

    if len(runs) == 2 and (run is not None or part is not None):
        raise UsageError("--between run:A,run:B names both recordings: give no RUN or --part (or --between run:B alone)")
    say = _say(as_json)
    with ExitStack() as stack:
        stack.enter_context(program_output_to_stderr())  # the program's prints: not into --json
        if len(runs) == 2:
            sa = open_side(runs[0], "A")
            stack.callback(sa.recording.close)
            part_a, rank_a, path_a = sa.part, sa.ranks[0] if sa.rank_given else rank, sa.recording.path
        else:
            rec, part_a = _part(run, root, part, as_json)
            stack.callback(rec.close)
            rank_a, path_a = rank, rec.path
        sb = open_side(runs[-1], "B")
        stack.callback(sb.recording.close)
        rank_b = sb.ranks[0] if sb.rank_given else rank
        for p in (part_a, sb.part):
            _admit(p, factory=options.factory, trust=trust, say=say)
        result = api.bisect_runs(part_a, sb.part, rank_a=rank_a, rank_b=rank_b, step=step, mode=mode, options=options,
                                 modules=modules, context=context, announce=say, progress=progress)
    return _finish(path_a, result, save=save, as_json=as_json)


@bisect.command(epilog="\b\nExamples:\n  replay bisect config --rank 3 --step 812 --toggles deterministic,tuner,cudagraph\n"
                       "  replay bisect config --rank 0 --step 5 --criterion reproduce\n"
                       "  replay bisect config --rank 3 --step 812 --criterion live")
@run_argument
@part_option
@click.option("--rank", type=int, default=None, help="The rank whose step diverges (default: the odd one at the first divergence).")
@click.option("--step", "step_index", type=int, default=None, help="The step (default: the first divergence).")
@click.option("--toggles", "toggles_text", multiple=True, metavar="NAME[=JSON]", help="Toggles to try (default: every one the target declares).")
@click.option("--criterion", type=click.Choice(CRITERIA), default=None,
              help="What matching means: ranks, eager, live, or reproduce (the recording itself) [from the recording].")
@click.option("--against", type=int, default=None, help="With --criterion ranks: the rank to match (default: the lowest of the majority).")
@click.option("--max-probes", type=click.IntRange(min=1), default=None, help="Stop after N new probes (run again to resume).")
@click.option("--fresh", is_flag=True, help="Forget a saved bisection and start over.")
@click.option("--probe-timeout", type=float, default=600.0, show_default=True, help="Seconds one probe may take.")
@_rerun_options
def config(run: Path | None, root: str, part: str | None, rank: int | None, step_index: int | None,
           toggles_text: tuple[str, ...], criterion: str | None, against: int | None, max_probes: int | None, fresh: bool,
           probe_timeout: float, device: str | None, factory: str | None, sets: tuple[str, ...], no_save: bool,
           trust: bool, as_json: bool) -> int:
    """The smallest set of toggles that makes a step match."""
    say = _say(as_json)
    rec, p = _part(run, root, part, as_json)
    with rec, program_output_to_stderr():  # the program's prints: not into the verdict or --json
        _admit(p, factory=factory, trust=trust, say=say)
        settings = ConfigBisectSettings(rank=rank, step=step_index, toggles=split_list(toggles_text) or None,
                                        criterion=criterion, against=against, device=device or api.default_device(p),
                                        factory=factory, options=parse_options(sets), max_probes=max_probes, fresh=fresh,
                                        timeout_s=probe_timeout)
        say("each probe re-runs the step in fresh processes")
        result = api.bisect_config(p, settings, announce=say, on_probe=lambda t: say(
            f"probe {', '.join(t.toggles) or '(recorded settings)'}: {t.outcome}"
            + (" (saved)" if t.cached else f" ({t.seconds:.1f} s)")))
    # An incomplete search is not a result to keep.
    return _finish(rec.path, result, save=not no_save and result.status != BisectStatus.INCOMPLETE, as_json=as_json)


# -- rendering ------------------------------------------------------------------------------


def render(result: StepsBisection | LayersBisection | ConfigBisection) -> str:
    """The text of a bisection: its verdict on the first line, then the evidence."""
    if isinstance(result, StepsBisection):
        return render_steps(result)
    if isinstance(result, LayersBisection):
        return render_layers(result)
    return render_config(result)


def render_steps(r: StepsBisection) -> str:
    lines = [_head(r.first is not None, r.verdict())]
    if r.how == StepsHow.RANKS:
        rows = []
        if r.first is not None:
            rows.append(["bits", r.first, escape(r.field or ""), ",".join(map(str, r.odd)), ",".join(map(str, r.majority))])
        if r.first_token is not None:
            rows.append(["tokens", r.first_token, escape(r.token_field or ""), "", ""])
        if rows:
            lines.append(table(["first divergence of", "step", "field", "odd ranks", "majority"], rows))
    elif r.probes:
        rows = [[f"{p.first}..{p.last}", style("departs at " + str(p.departed), fg="red") if p.departed is not None else
                 style("as recorded", fg="green"), escape(p.field or ""), f"{p.seconds:.2f}"]
                for p in sorted(r.probes, key=lambda p: p.first)]
        lines.append(table(["steps re-run", "result", "field", "seconds"], rows))
    lines += [f"  note: {escape(n)}" for n in r.notes]
    return "\n".join(lines)


def _row(i: int, m: ModuleVerdict, first: ModuleVerdict | None) -> list[Any]:
    c = m.comparison
    name = style(escape(m.name), bold=True) if m is first else escape(m.name)
    inputs = "-" if m.inputs_equal is None else ("equal" if m.inputs_equal else "differ")
    # Tensors of other row counts have no figures: the columns say how many rows each side has.
    inputs += f" ({m.input_rows})" if m.input_rows else ""
    return [i, name, fmt_verdict(m.verdict) + (f" ({m.rows})" if m.rows else "") + (" (rank-local)" if m.rank_local else ""),
            "-" if c is None or c.max_abs is None else f"{c.max_abs:.3g}",
            "-" if c is None or c.max_rel is None else f"{c.max_rel:.3g}", inputs, escape(m.source)]


def _shown_modules(r: LayersBisection) -> list[ModuleVerdict]:
    """The modules before the first that differs (``context``), it and three after, and the
    module that made the difference."""
    if r.first is None:
        return r.modules[-min(len(r.modules), 4):]
    at = next(i for i, m in enumerate(r.modules) if m is r.first)
    shown = [*r.before, *r.modules[at:at + 4]]
    if r.maker is not None and all(m is not r.maker for m in shown):
        shown.append(r.maker)
    return shown


def render_layers(r: LayersBisection) -> str:
    lines = [_head(r.first is not None, r.verdict())]
    if r.origin:
        lines.append(f"  {escape(r.origin)}")
    if r.modules:
        idx = {id(m): i for i, m in enumerate(r.modules)}
        shown = _shown_modules(r)
        lines.append(f"module outputs ({len(r.modules)} compared, in execution order; {len(shown)} shown, all with --json):")
        lines.append(table(["#", "module", "verdict", "max abs", "max rel", "inputs", "ran"],
                           [_row(idx[id(m)], m, r.first) for m in shown]))
        tolerances = sorted({c.verdict_text for m in shown if (c := m.comparison) is not None and c.verdict is Verdict.WITHIN_TOLERANCE})
        if tolerances:
            lines.append(f"  {'; '.join(tolerances)}: the tolerance of the output's dtype")
    lines += [f"  step output: {escape(c)}" for c in r.outputs if not c.equal]
    if r.equal_inputs is not None:
        # Between two runs whose inputs already differed: run A against run B's model on run A's data.
        sub = r.equal_inputs
        lines.append(f"from equal inputs: {escape(sub.verdict())}")
        if sub.origin:
            lines.append(f"  {escape(sub.origin)}")
    if r.silent:
        lines.append(f"  {len(r.silent)} tapped module(s) never ran in this step on either side: {escape(', '.join(r.silent[:6]))}")
    lines += [f"  note: {escape(n)}" for n in r.notes]
    return "\n".join(lines)


_OUTCOME_COLOUR = {"matches": "green", "differs": "red"}


def render_config(r: ConfigBisection) -> str:
    lines = [_head(r.status in (BisectStatus.DONE, BisectStatus.NO_FIX), r.verdict())]
    if r.candidates:
        lines.append("  toggles tried: " + escape(", ".join(c.label for c in r.candidates)))
    rows = [[escape(", ".join(t.toggles) or "(recorded settings)"), style(str(t.outcome), fg=_OUTCOME_COLOUR.get(t.outcome, "yellow")),
             "saved" if t.cached else f"{t.seconds:.1f} s", escape((t.error or "")[:80])] for t in r.tried]
    if rows:
        lines.append(table(["changes", "outcome", "probe", "error"], rows))
    lines += [f"  note: {escape(n)}" for n in r.notes]
    return "\n".join(lines)


def _head(bad: bool, text: str) -> str:
    return style(escape(text), fg="red" if bad else "green", bold=True)
