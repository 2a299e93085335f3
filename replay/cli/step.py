"""``replay step``: re-run one step of one rank, eagerly, under a CUDA graph, or both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import torch

from replay.analysis.summary import choose_part
from replay.cli.common import emit_json, json_option, open_run, part_option, run_argument, save_and_emit
from replay.cli.render import style, table
from replay.errors import UsageError
from replay.rerun.runner import StepRerun, rerun_step

EPILOG = """\b
Examples:
  replay step --rank 3 --step 812 --mode both
  replay step RUN --rank 0 --step 40 --mode eager --device cpu --repeat 5
  replay step --rank 2 --step 57 --factory mypkg.engine:build --json
  replay step --ranks 0-3 --step 57 --devices cuda:0,cuda:1
"""


def parse_ranks(text: str) -> list[int]:
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


def default_device(recorded: str | None) -> str:
    if recorded and recorded.startswith("cuda") and torch.cuda.is_available():
        return "cuda:0"
    return "cpu"


@click.command(epilog=EPILOG)
@run_argument
@part_option
@click.option("--rank", type=int, default=None, help="The rank to re-run.")
@click.option("--ranks", "ranks_text", default=None, help="Several ranks (0-7 or 0,3): one process each.")
@click.option("--step", "step_index", type=int, required=True, help="The step to re-run.")
@click.option("--mode", type=click.Choice(["eager", "cudagraph", "both"]), default="both", show_default=True)
@click.option("--device", default=None, help="cpu or cuda:N (default: cuda:0 if the run was on a GPU and one is here).")
@click.option("--devices", default=None, help="With --ranks: devices to spread ranks over (cuda:0,cuda:1 or cpu).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Run the step N times from the same state.")
@click.option("--factory", default=None, metavar="MODULE:QUALNAME", help="Rebuild the target with this factory instead.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a target toggle (JSON value).")
@click.option("--no-save", is_flag=True, help="Do not save the result beside the recording.")
@click.option("--trust", is_flag=True,  # issue 16
              help="Import the code this recording names even though it is not your own signed recording (see docs/security.md).")
@json_option
def step(run: Path | None, root: str, part: str | None, rank: int | None, ranks_text: str | None, step_index: int,
         mode: str, device: str | None, devices: str | None, repeat: int, factory: str | None, sets: tuple[str, ...],
         no_save: bool, as_json: bool, trust: bool = False) -> int:
    """Re-run step STEP of a rank of RUN (default: the newest recording) and compare it."""
    if (rank is None) == (ranks_text is None):
        raise UsageError("give --rank R (one rank) or --ranks LIST (several)")
    options = parse_options(sets)
    modes = ["eager", "cudagraph"] if mode == "both" else [mode]
    with open_run(run, root, quiet=as_json) as rec:
        chosen = choose_part(rec, part)
        from replay.trust import admit_part  # issue 16: one line before anything is imported

        admit_part(chosen, factory=factory, trust=trust, recording=rec.path,
                   ranks=[rank] if rank is not None else parse_ranks(ranks_text or ""))
        if ranks_text is not None:
            from replay.rerun.multi import rerun_ranks

            ranks = parse_ranks(ranks_text)
            results = rerun_ranks(rec.path, chosen.name, ranks, step_index, modes=modes, devices=devices,
                                  repeat=repeat, factory=factory, options=options)
            if as_json:
                emit_json({"kind": "step-ranks", "results": [r for r in results]})
            else:
                for r in results:
                    click.echo(render_step_json(r))
            return 0
        rf = chosen[rank]
        rf.step(step_index)
        target = rf.attrs.get("target") or {}
        dev = device or default_device(target.get("device") if isinstance(target, dict) else None)
        announce = (lambda s: None) if as_json else (lambda s: click.echo(f"replay: {s}", err=True))
        try:
            from replay.cli.progress import progress
        except ImportError:  # pragma: no cover
            progress = lambda it, label="": it  # noqa: E731

        result = rerun_step(chosen, rank, step_index, modes=modes, device=dev, repeat=repeat, factory=factory,
                            options=options, recording=str(rec.path), announce=announce, progress=progress)
    save_and_emit(rec.path, result.to_json(), "" if as_json else render_step(result), save=not no_save, as_json=as_json)
    return 0


def render_step(r: StepRerun) -> str:
    lines = [f"rank {r.rank}, step {r.step} of {r.recording} (part {r.part}) on {r.device}, from the keyframe at step {r.keyframe}"]
    for m in r.modes.values():
        if r.step > r.keyframe:
            if m.departed is None:
                lines.append(f"  {m.mode}: steps {r.keyframe}..{r.step - 1} re-ran bit for bit as recorded")
            else:
                lines.append(style(f"  {m.mode}: the re-run departed from the recording at {m.departed} (teacher-forced from there)", fg="yellow"))
        for c in m.collective_mismatches[:3]:
            lines.append(style(f"  {m.mode}: {c}", fg="yellow"))
        if m.error or m.recorded_error:
            kind = (m.error or "").split(":")[0]
            if m.error and kind == (m.recorded_error or "").split(":")[0]:
                lines.append(style(f"  {m.mode}: step {r.step} raised {kind}, as it did when recorded: {m.recorded_error}", fg="yellow"))
            else:
                what = f"raised {m.error}" if m.error else "completed"
                rec = f"raised {m.recorded_error}" if m.recorded_error else "completed"
                lines.append(style(f"  {m.mode}: step {r.step} {what}; when recorded it {rec}", fg="red"))
    rows = []
    for m in r.modes.values():
        for name, c in m.vs_recording.items():
            ranks = m.matches_ranks.get(name, [])
            verdict = style(str(c.verdict), fg="green" if c.equal else "red")
            rep = "-" if m.repeats_equal is None else ("same bits" if m.repeats_equal else style("bits vary", fg="red"))
            rows.append([m.mode, name, verdict, ",".join(map(str, ranks)) or "none", rep, m.graph or "-"])
    if rows:
        lines.append(f"step {r.step} against the recording:")
        lines.append(table(["mode", "output", f"vs rank {r.rank} recorded", "same bits as ranks", "repeats", "ran as"], rows))
    for c in r.comparisons:
        lines.append(f"  {c}")
    for m in r.modes.values():
        if m.repeats_equal is False:
            lines.append(style(f"  {m.mode}: repeated runs of the same step from the same state gave different bits: "
                               "a nondeterministic kernel", fg="red"))
    for n in r.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def render_step_json(d: dict[str, Any]) -> str:
    head = f"rank {d.get('rank')}: step {d.get('step')}"
    modes = d.get("modes", {})
    parts = []
    for name, m in modes.items():
        vs = m.get("vs_recording", {})
        parts.append(f"{name}: " + ", ".join(f"{k} {v.get('verdict')}" for k, v in vs.items()))
    return head + (" | " + " | ".join(parts) if parts else "") + (f" | error: {d['error']}" if d.get("error") else "")
