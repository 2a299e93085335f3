"""``replay bisect``: the first step, the first layer, or the smallest setting where a step diverges."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from replay.analysis.divergence import first_divergence
from replay.analysis.summary import choose_part
from replay.bisect.config import (
    CRITERIA,
    ConfigBisection,
    ConfigBisectSettings,
    bisect_config,
)
from replay.bisect.layers import (
    LayersBisection,
    ModuleVerdict,
    bisect_layers,
    parse_between,
    recorded_mode,
)
from replay.bisect.steps import StepsBisection, bisect_steps, bisect_steps_rerun
from replay.cli.common import json_option, open_run, part_option, run_argument, save_and_emit
from replay.cli.progress import progress
from replay.cli.render import fmt_verdict, style, table
from replay.cli.step import default_device, parse_options, parse_ranks
from replay.errors import RerunError, UsageError  # [foreign] RerunError: exit code of a bisection that compared nothing
from replay.textsafe import escape
from replay.format.reader import Part

EPILOG = """\b
Examples:
  replay bisect --steps                                    first step where the ranks disagree (by majority)
  replay bisect --steps --ranks 0,3                        ... where ranks 0 and 3 disagree
  replay bisect --steps --against-rerun --rank 3           first step whose re-run departs from the recording
  replay bisect --rank 3 --step 812 --between eager,cudagraph     first module that differs
  replay bisect --step 812 --between rank:0,rank:3 --modules 'layers.*'
  replay bisect --rank 3 --step 812 --between recorded,rerun
  replay bisect --rank 3 --step 812 --config --toggles deterministic,tuner,cudagraph
  replay bisect --rank 3 --step 812 --config --criterion live     all ranks at once, live collectives
"""


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


@click.command(epilog=EPILOG)
@run_argument
@part_option
@click.option("--steps", "by_steps", is_flag=True, help="Find the first step that differs.")
@click.option("--ranks", "ranks_text", default=None, help="With --steps: the ranks to compare (0,3 or 0-7; default all, by majority).")
@click.option("--against-rerun", is_flag=True, help="With --steps: compare the recording of --rank with re-runs of it.")
@click.option("--exhaustive", is_flag=True, help="With --against-rerun: re-run every keyframe interval in order, not a binary search.")
@click.option("--between", default=None, metavar="A,B", help="Find the first module that differs: eager,cudagraph | rank:0,rank:3 | recorded,rerun.")
@click.option("--modules", "modules_text", multiple=True, metavar="PATTERN", help="With --between: tap only modules matching these globs (comma-separated).")
@click.option("--context", type=click.IntRange(min=0), default=3, show_default=True, help="With --between: modules shown before the first that differs.")
@click.option("--config", "by_config", is_flag=True, help="Find the smallest set of toggles that makes the step match.")
@click.option("--toggles", "toggles_text", multiple=True, metavar="NAME[=JSON]", help="With --config: toggles to try (default: every one the target declares).")
@click.option("--criterion", type=click.Choice(CRITERIA), default=None, help="With --config: what matching means (default: from the recording).")
@click.option("--against", type=int, default=None, help="With --config: the rank to match (default: the lowest rank of the majority).")
@click.option("--max-probes", type=click.IntRange(min=1), default=None, help="With --config: stop after N new probes (run again to resume).")
@click.option("--fresh", is_flag=True, help="With --config: forget a saved bisection and start over.")
@click.option("--probe-timeout", type=float, default=600.0, show_default=True, help="With --config: seconds one probe may take.")
@click.option("--rank", type=int, default=None, help="The rank to re-run.")
@click.option("--step", "step_index", type=int, default=None, help="The step to bisect.")
@click.option("--mode", type=click.Choice(["eager", "cudagraph"]), default=None, help="Mode of re-runs that name none (default eager).")
@click.option("--device", default=None, help="cpu or cuda:N (default: cuda:0 if the run was on a GPU and one is here).")
@click.option("--factory", default=None, metavar="MODULE:QUALNAME", help="Rebuild the target with this factory instead.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a target toggle in every re-run (JSON value).")
@click.option("--no-save", is_flag=True, help="Do not save the result beside the recording.")
@click.option("--trust", is_flag=True,  # issue 16
              help="Import the code this recording names even though it is not your own signed recording (see docs/security.md).")
@json_option
def bisect(run: Path | None, root: str, part: str | None, by_steps: bool, ranks_text: str | None, against_rerun: bool,
           exhaustive: bool, between: str | None, modules_text: tuple[str, ...], context: int, by_config: bool,
           toggles_text: tuple[str, ...], criterion: str | None, against: int | None, max_probes: int | None, fresh: bool,
           probe_timeout: float, rank: int | None, step_index: int | None, mode: str | None, device: str | None,
           factory: str | None, sets: tuple[str, ...], no_save: bool, as_json: bool, trust: bool = False) -> int:
    """Bisect RUN (default: the newest recording) across steps, layers or settings."""
    chosen_modes = [name for name, on in (("--steps", by_steps), ("--between", between is not None), ("--config", by_config)) if on]
    if len(chosen_modes) != 1:
        raise UsageError("say what to bisect: --steps, --between A,B or --config" if not chosen_modes
                         else f"{' and '.join(chosen_modes)} cannot be combined: run one bisection at a time")
    options = parse_options(sets)
    say: Callable[[str], None] = (lambda s: None) if as_json else (lambda s: click.echo(f"replay: {s}", err=True))
    with open_run(run, root, quiet=as_json) as rec:
        p = choose_part(rec, part)
        if not (by_steps and not against_rerun):  # issue 16: a re-run imports code; say what, before it does
            from replay.trust import admit_part

            imports = admit_part(p, factory=factory, trust=trust, recording=rec.path)
            if imports:
                say(f"importing {', '.join(imports[:3])}{' and more' if len(imports) > 3 else ''} (named by the recording)")
        target = p[next(iter(p))].attrs.get("target") or {}
        dev = device or default_device(target.get("device") if isinstance(target, dict) else None)
        result: Any
        if by_steps:
            if ranks_text and against_rerun:
                raise UsageError("--ranks compares recorded ranks, --against-rerun compares one rank with re-runs: pick one")
            if against_rerun:
                r = rank if rank is not None else _odd_rank(p, say)
                result = bisect_steps_rerun(p, r, mode=mode or "eager", device=dev, factory=factory, options=options,
                                            exhaustive=exhaustive, recording=str(rec.path), announce=say, progress=progress)
            else:
                result = bisect_steps(p, ranks=parse_ranks(ranks_text) if ranks_text else None, recording=str(rec.path))
        elif between is not None:
            step = step_index
            if step is None:
                a0, b0 = parse_between(between, rank=rank, mode=mode, recorded=lambda r: "eager", options=options)
                if a0.rank == b0.rank:
                    raise UsageError(f"--between {between}: give --step S (`replay bisect --steps --against-rerun --rank {a0.rank}` finds one)")
                d = first_divergence(p, ranks=[a0.rank, b0.rank])
                if d is None:
                    raise UsageError(f"ranks {a0.rank} and {b0.rank} never disagree: give --step S")
                step = d.step
                say(f"bisecting step {step}, where ranks {a0.rank} and {b0.rank} first disagree ({d.field})")
            at = step
            a, b = parse_between(between, rank=rank, mode=mode, recorded=lambda r: recorded_mode(p, r, at), options=options)
            say(f"re-running step {step} as {a.label} and as {b.label}, with taps on every module")
            result = bisect_layers(p, step, a, b, modules=split_list(modules_text) or None, device=dev, factory=factory,
                                   context=context, recording=str(rec.path), progress=progress)
        else:
            if rank is None or step_index is None:
                d = first_divergence(p)
                if d is None:
                    raise UsageError("the ranks never disagree: give --rank R and --step S (and --criterion eager to compare "
                                     "a CUDA graph re-run with an eager one)")
                rank = d.ranks[0] if rank is None else rank
                step_index = d.step if step_index is None else step_index
                say(f"bisecting the settings of rank {rank} at step {step_index}, the first divergence ({d.field})")
            r, s = rank, step_index
            settings = ConfigBisectSettings(rank=r, step=s, toggles=split_list(toggles_text) or None, criterion=criterion,
                                            against=against, device=dev, factory=factory, options=options,
                                            max_probes=max_probes, fresh=fresh, timeout_s=probe_timeout)
            say("each probe re-runs the step in fresh processes")
            result = bisect_config(rec.path, p.name, settings, announce=say,
                                   on_probe=lambda t: say(f"probe {', '.join(t.toggles) or '(recorded settings)'}: {t.outcome}"
                                                          + (" (saved)" if t.cached else f" ({t.seconds:.1f} s)")))
    # An incomplete configuration search is not a result to keep.
    save = not no_save and not (isinstance(result, ConfigBisection) and result.status == "incomplete")
    save_and_emit(rec.path, result.to_json(), "" if as_json else render(result), save=save, as_json=as_json)
    # [foreign: truthful verdicts] a layer bisection whose step raised, or that compared nothing, is not a result.
    problem = result.problem() if isinstance(result, LayersBisection) else None
    if problem is not None:
        click.echo(f"replay: {escape(problem)}", err=True)
        return RerunError.exit_code
    return 0


def _odd_rank(p: Part, say: Callable[[str], None]) -> int:
    d = first_divergence(p)
    r = d.ranks[0] if d is not None and d.ranks else next(iter(p))
    say(f"re-running rank {r}" + (f", the odd rank at the first divergence (step {d.step})" if d is not None else ""))
    return r


def render(result: StepsBisection | LayersBisection | ConfigBisection) -> str:
    if isinstance(result, StepsBisection):
        return render_steps(result)
    if isinstance(result, LayersBisection):
        return render_layers(result)
    return render_config(result)


def render_steps(r: StepsBisection) -> str:
    lines = [_head(r.first is not None, r.verdict())]
    if r.how == "ranks":
        rows = []
        if r.first is not None:
            rows.append(["bits", r.first, r.field, ",".join(map(str, r.odd)), ",".join(map(str, r.majority))])
        if r.first_token is not None:
            rows.append(["tokens", r.first_token, r.token_field, "", ""])
        if rows:
            lines.append(table(["first divergence of", "step", "field", "odd ranks", "majority"], rows))
    elif r.probes:
        rows = [[f"{p.first}..{p.last}", style("departs at " + str(p.departed), fg="red") if p.departed is not None else
                 style("as recorded", fg="green"), p.field or "", f"{p.seconds:.2f}"] for p in sorted(r.probes, key=lambda p: p.first)]
        lines.append(table(["steps re-run", "result", "field", "seconds"], rows))
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def _row(i: int, m: ModuleVerdict, first: ModuleVerdict | None) -> list[Any]:
    c = m.comparison
    name = style(m.name, bold=True) if m is first else m.name
    inputs = "-" if m.inputs_equal is None else ("equal" if m.inputs_equal else "differ")
    return [i, name, fmt_verdict(m.verdict) + (" (rank-local)" if m.rank_local else ""),
            "-" if c is None or c.max_abs is None else f"{c.max_abs:.3g}",
            "-" if c is None or c.max_rel is None else f"{c.max_rel:.3g}", inputs, m.source]


def render_layers(r: LayersBisection) -> str:
    lines = [_head(r.first is not None, r.verdict())]
    if r.origin:
        lines.append(f"  {r.origin}")
    if r.modules:
        idx = {id(m): i for i, m in enumerate(r.modules)}
        if r.first is not None:
            at = idx[id(r.first)]
            shown = [m for m in r.before] + r.modules[at:at + 4]
            if r.maker is not None and r.maker not in shown:
                shown.append(r.maker)
        else:
            shown = r.modules[-min(len(r.modules), 4):]
        lines.append(f"module outputs ({len(r.modules)} compared, in execution order; {len(shown)} shown, all with --json):")
        lines.append(table(["#", "module", "verdict", "max abs", "max rel", "inputs", "ran"],
                           [_row(idx[id(m)], m, r.first) for m in shown]))
    for c in r.outputs:
        if not c.equal:
            lines.append(f"  step output: {c}")
    if r.silent:
        lines.append(f"  {len(r.silent)} tapped module(s) never ran in this step on either side: {', '.join(r.silent[:6])}")
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def render_config(r: ConfigBisection) -> str:
    lines = [_head(r.status in ("done", "no-fix"), r.verdict())]
    if r.candidates:
        lines.append("  toggles tried: " + ", ".join(c.label for c in r.candidates))
    rows = []
    for t in r.tried:
        outcome = {"matches": style("matches", fg="green"), "differs": style("differs", fg="red")}.get(t.outcome, style(t.outcome, fg="yellow"))
        rows.append([", ".join(t.toggles) or "(recorded settings)", outcome, "saved" if t.cached else f"{t.seconds:.1f} s",
                     (t.error or "")[:80]])
    if rows:
        lines.append(table(["changes", "outcome", "probe", "error"], rows))
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def _head(bad: bool, text: str) -> str:
    return style(text, fg="red" if bad else "green", bold=True)
