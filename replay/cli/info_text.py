"""The text of ``replay info``, shared by ``replay info`` and ``replay record`` (which prints the
same summary when the command ends): one verdict line first, then one line per fact."""

from __future__ import annotations

import shlex
from typing import Any

from replay import api
from replay.analysis.divergence import INPUT_SUFFIX, NO_OUTPUT_FIELDS, OUTPUT_REMEDY
from replay.analysis.offset import offset_text
from replay.analysis.summary import divergence_what, rank_only_note, step_count_note, verdict_line
from replay.cli.render import fmt_margin, style, table
from replay.textsafe import a_or_an, escape

__all__ = ["render_info"]


def render_info(result: api.InfoResult | dict[str, Any]) -> str:
    """The text of ``replay info``: one line per fact, the first divergence, then the next command."""
    s = result.to_json() if isinstance(result, api.InfoResult) else result
    verdict = verdict_line(s)
    colour = "green" if verdict.startswith("no divergence") else None if verdict.startswith(("one rank", "nothing compared")) else "red"
    lines = [style(escape(verdict), fg=colour, bold=colour == "red")]
    lines += _header(s)
    lines.append(_rank_table(s["ranks"]))
    lines += _stream_lines(s)
    lines += _unrecorded_lines(s)
    lines += [style(f"while recording, {escape(e)}", fg="yellow") for e in s.get("lockstep") or []]
    lines += _rank_problems(s)
    lines += _divergence_lines(s)
    lines += _difference_lines(s)
    target = s["first_token_divergence"] or s["first_divergence"]
    # No --mode: `replay step` picks the modes this recording and this machine can run. With
    # several parts, the part shown is named: another may be the command's default.
    part = f" --part {escape(s['part'])}" if len(s["parts"]) > 1 else ""
    # The recording itself: without it the command takes the newest under recordings/, which is
    # not this one for a recording made with --out (or once another is made).
    part = f" {escape(shlex.quote(str(s['recording'])))}{part}" if s.get("recording") else part
    if target is not None:
        lines.append(f"next: replay step{part} --rank {target['ranks'][0]} --step {target['step']}{_next_why(target, part)}")
    elif len(s["ranks"]) == 1 and s["ranks"][0].get("steps") and s.get("output_fields") is not False:
        r = s["ranks"][0]
        lines.append(f"next: replay step{part} --rank {r['rank']} --step {int(r['steps']) - 1}   (re-run a step against its recording)")
    return "\n".join(lines)


def _next_why(target: dict[str, Any], part: str) -> str:
    """What the step re-run can tell where a collective's input is what differs: the step's own
    fields agree across the ranks there, so its re-run may well reproduce; the input may be made
    by the program's code around the step (a token sampled before a broadcast), which a step
    re-run does not run."""
    field = str(target.get("field") or "")
    if not field.endswith(INPUT_SUFFIX):
        return ""
    return (f"   (its recorded fields agree across the ranks here, so it may well reproduce; the input of "
            f"{escape(field[:-len(INPUT_SUFFIX)])} is made either inside the step (`replay bisect layers{part} --step "
            f"{target['step']} --between rank:{target['majority'][0] if target.get('majority') else 0},rank:{target['ranks'][0]}` finds where) or by "
            "the program's code around it, a token sampled before a broadcast say, which a step re-run does not run)")


def _header(s: dict[str, Any]) -> list[str]:
    lines = [f"recording   {escape(s['recording'])}"]
    if s.get("command"):
        # The manifest is data from disk: render whatever is there, never fail on its type.
        c = s["command"]
        cmd = " ".join(map(str, c)) if isinstance(c, list) else str(c)
        lines.append(f"command     {escape(cmd)}{_ended(s)}")
    if len(s["parts"]) > 1:
        marks = [f"{escape(p['name'])}{' (diverged)' if p['diverged'] else ''}{' (cannot be read)' if p.get('problem') else ''}"
                 for p in s["parts"]]
        lines.append(f"parts       {', '.join(marks)}; showing {escape(s['part'])}")
    lines.append(f"world size  {s['world_size']}")
    steps = s.get("step_callables") or []
    if steps:
        # Which callable each step is: what a re-run calls, and what --step would name.
        shown = ", ".join((f"{escape(c['stream'])}: " if c.get("stream") else "") + escape(c["step"])
                          + (f" ({escape(_KIND.get(c.get('kind') or '', c.get('kind') or ''))})" if c.get("kind") else "")
                          for c in steps)
        lines.append(f"step        {shown}{_first_calls(s)}")
    return lines


def _first_calls(s: dict[str, Any]) -> str:
    """Calls of the step made before its step 0 and not recorded: the recording's step numbers
    are the program's calls less these (with no flags, the prefill is call 0 and decode step 1
    is step 0)."""
    calls = set((s.get("unrecorded_calls") or {}).values())
    if len(calls) != 1:
        return "" if not calls else "; the first call(s) of the step on each rank were not recorded (before step 0)"
    n = calls.pop()
    return (f"; recorded from its call {n + 1}: the first {n} ran before the step was found, so step 0 is the program's call "
            f"{n + 1}" if n > 1 else "; recorded from its second call: the first (often the prefill) ran before the step was found, "
            "so step 0 is the program's second call")


def _ended(s: dict[str, Any]) -> str:
    """How the recorded command ended, where not with exit code 0: a program that stopped
    mid-loop (sys.exit(3), a signal) recorded fewer steps than it meant to."""
    sig, code = s.get("command_signal"), s.get("command_exit_code")
    if isinstance(sig, int) and sig > 0:
        return f"   (ended by signal {sig})"
    if isinstance(code, int) and code != 0:
        return f"   (exited with code {code})"
    return ""


_KIND = {"module_forward": "an nn.Module's forward", "compiled": "torch.compile'd", "function": "a function",
         "method": "a method"}


def _rank_table(ranks: list[dict[str, Any]]) -> str:
    rows = []
    for r in ranks:
        state = "live" if r["live"] else ("yes" if r["complete"] else style("no", fg="yellow"))
        where = escape(r["host"]) + (f" (node {r['node_rank']})" if r.get("node_rank") is not None else "")
        rows.append([r["rank"], r["steps"], state, r["graphs_captured"], r["graph_steps"], r["eager_steps"], r["raised_steps"], where])
    return table(["rank", "steps", "complete", "graphs", "graph steps", "eager steps", "raised", "host"], rows)


def _stream_lines(s: dict[str, Any]) -> list[str]:
    """Several models in one loop: a step sequence per stream (step numbers count all streams)."""
    streams = s.get("streams") or []
    if not streams:
        return []
    compared = len(s["ranks"]) > 1
    rows = []
    for x in streams:
        row = [escape(x["stream"]), x["steps"], x["first_step"], x["last_step"]]
        if compared:
            d = x.get("first_divergence")
            row.append(f"step {d['step']} (its step {d.get('stream_step', '?')}): {escape(d['field'])} on rank(s) {_ranks(d['ranks'])}"
                       if d else "none across ranks")
        rows.append(row)
    head = ["stream", "steps", "first step", "last step"] + (["first divergence"] if compared else [])
    head_line = (f"streams     {len(streams)} models in one loop, one step sequence each (step numbers count all, in program order)"
                 if len(streams) > 1 else f"stream      {escape(streams[0]['stream'])}: the only model with recorded steps of those the program ran")
    return [head_line,
            table(head, rows)]


def _where(d: dict[str, Any]) -> str:
    """``step 9`` or ``step 9 (stream target, its step 3)``."""
    if d.get("stream") is None:
        return f"step {d['step']}"
    return f"step {d['step']} (stream {escape(str(d['stream']))}, its step {d.get('stream_step', '?')})"


def _unrecorded_lines(s: dict[str, Any]) -> list[str]:
    """Fields the recorder could not record: no verdict of this recording covers them."""
    fields = s.get("unrecorded_fields") or {}
    if not fields:
        return []
    named = ", ".join(f"{escape(k)} ({a_or_an(escape(v))})" for k, v in fields.items())
    return [f"not recorded  {named}: values that are not a dense array; no verdict compares them"]


def _rank_problems(s: dict[str, Any]) -> list[str]:
    lines = [style(f"  rank {m}: no file", fg="red") for m in s["missing_ranks"]]
    lines += [style(f"  rank {u['rank']}: left out, {escape(u['problem'])}", fg="red") for u in s["unreadable_ranks"]]
    for r in s["ranks"]:
        if r["problem"]:
            lines.append(style(f"  rank {r['rank']}: {escape(r['problem'])}", fg="yellow"))
        elif not r["complete"] and not r.get("live"):
            lines.append(style(_ended_early(r), fg="yellow"))
        if r["last_error"]:
            lines.append(f"  rank {r['rank']} raised: {escape(r['last_error'])}")
        if r.get("uncaught") and r["uncaught"] != r["last_error"]:  # (a step's own error is said above)
            lines.append(style(f"  rank {r['rank']}: its program ended on an uncaught {escape(r['uncaught'])} (after its "
                               f"{int(r.get('steps') or 0)} recorded steps)", fg="red"))
        lines += _record_ring_line(r)
    training = s.get("training_modes")
    if training:
        shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(training.items(), key=lambda kv: int(kv[0]))[:8])
        lines.append(style(f"  the ranks' models were in different modes at their first recorded step (modules in training "
                           f"mode: {shown}); dropout and batch norm compute otherwise in training mode: a missing .eval()?", fg="red"))
    return lines


def _ended_early(r: dict[str, Any]) -> str:
    """A rank whose process ended without its end marker, or whose recorder stopped itself: what
    is kept, and how to finish it."""
    n = int(r.get("steps") or 0)
    kept = f"steps 0..{n - 1} are kept" if n else "no step was kept"
    if r.get("stopped"):
        return (f"  rank {r['rank']}: the recorder stopped itself ({escape(str(r['stopped']))}): {kept}; the steps the "
                "program ran after that were not recorded")
    seal = "; its file is not sealed: `replay seal` seals it" if not r.get("sealed") else ""
    return (f"  rank {r['rank']}: ended without its end marker (killed, crashed, or os._exit): {kept}{seal} "
            "(`replay verify` checks what it holds)")


def _record_ring_line(r: dict[str, Any]) -> list[str]:
    """issue 15: the record ring of a rank that waited for room or dropped steps (quiet otherwise)."""
    g = r.get("record_ring")
    if not isinstance(g, dict) or not (g.get("full_waits") or g.get("dropped_steps")):
        return []
    text = (f"  rank {r['rank']}: record ring ({int(g['bytes']) >> 20} MiB, policy {escape(str(g['policy']))}) "
            f"full {g['full_waits']} times, {float(g['full_wait_s']):.3f} s waited, {g['dropped_steps']} steps dropped")
    return [style(text, fg="yellow" if g.get("dropped_steps") else None)]


def _ranks(xs: list[int]) -> str:
    return ", ".join(map(str, xs))


def _divergence_lines(s: dict[str, Any]) -> list[str]:
    d, t = s["first_divergence"], s["first_token_divergence"]
    if d is None and len(s["ranks"]) < 2:
        lines = _one_rank_lines(s)
    elif d is None and any(not int(r.get("steps") or 0) for r in s["ranks"]):
        lines = ["nothing compared: a rank recorded no step, so the ranks share no step to compare"]
    elif d is None and s.get("output_fields") is False:
        lines = [escape(verdict_line(s)) if rank_only_note(s) else f"nothing compared: {NO_OUTPUT_FIELDS}"]
    elif d is None:
        read = "every rank that can be read" if s["unreadable_ranks"] else "every rank"
        only = rank_only_note(s)
        lines = [style(f"no divergence: {read} recorded the same bits at every common step"
                       f"{' in the fields they all record' if only else ''}{step_count_note(s['ranks'])}", fg="green")]
        lines += [escape(only)] if only else []
    else:
        lines = _at_divergence_lines(s, d)
    return lines + _token_lines(s, d, t)


def _token_lines(s: dict[str, Any], d: dict[str, Any] | None, t: dict[str, Any] | None) -> list[str]:
    """The first token divergence, or what is known of tokens without one."""
    lines: list[str] = []
    if t is not None:
        lines.append(style(f"first token divergence  {_where(t)}: {escape(t['field'])} differs on rank(s) "
                           f"{_ranks(t['ranks'])}", fg="red", bold=True))
        margins = s.get("margin_at_token_divergence", {})
        if margins:
            lines.append("  smallest top-1/top-2 margin of the step's rows: " + ", ".join(f"r{r} {fmt_margin(m)}" for r, m in margins.items()))
    elif d is not None and s.get("output_fields") is False:
        lines.append("no step output recorded: only what went into the steps was compared, and a step that computed otherwise "
                     "shows only in a later step's input, so the ranks may have differed earlier; to compare what the steps "
                     "compute, record a callable inside the step with --probe (a step that writes into a buffer and returns "
                     "nothing has no output to name)")
    elif d is not None and s.get("token_fields") is False:
        lines.append("no token field recorded: the ranks differ in bits; what they sampled was not recorded as tokens")
    elif d is not None and s.get("offset_at_divergence"):
        lines.append("no token divergence once the offset is taken into account: the steps the ranks' tokens differ at "
                     "as numbered are other steps, with the same bits once shifted")
    elif d is not None:
        lines.append("no token divergence: the ranks differ in bits but sampled the same tokens")
    return lines


def _at_divergence_lines(s: dict[str, Any], d: dict[str, Any]) -> list[str]:
    """The first divergence, and what else the recording says of its step: ranks offset by a
    call, the numerics settings and arguments the diverging rank's step took otherwise."""
    lines = [style(f"first divergence        {_where(d)}: {escape(divergence_what(d))}", fg="red", bold=True)]
    if s.get("offset_at_divergence"):
        lines.append(style(f"  {escape(offset_text(s['offset_at_divergence']))}", fg="yellow"))
    elif d["step"] == 0 and str(d["field"]).startswith("input."):
        lines.append(style("  the ranks' inputs differ at the first recorded step: they differed before it (in the program's "
                           "set-up, or in a call of the step that was not recorded: with no flags, a module's first call, the "
                           "prefill, is not); or the ranks serve different requests by design (data parallel), which "
                           "info compares as replicas: check each rank against its own recording with replay step, or "
                           "against another run with replay diff", fg="yellow"))
    elif d["step"] == 0 and s.get("unrecorded_calls"):
        calls = s["unrecorded_calls"]
        odd = [str(r) for r in d["ranks"] if str(r) in calls]
        if odd:
            n = calls[odd[0]]
            lines.append(style(f"  rank {odd[0]} called the step {n} time{'s' if n > 1 else ''} before its step 0, not recorded (with "
                               "no flags a module's step is found at its second call: the first, the prefill, runs "
                               "unrecorded): the inputs of step 0 agree, so the state it began from may already have differed, "
                               "made by that call; a re-run of step 0 starts from the recorded state and may reproduce; to "
                               f"record from the first call, name the step: replay record --step {_step_name(s)} -- ...",
                               fg="yellow"))
    lines += _numerics_lines(s.get("numerics_at_divergence"))
    return lines + _numerics_lines(s.get("arguments_at_divergence"), what="arguments") + _python_state_lines(s)


def _python_state_lines(s: dict[str, Any]) -> list[str]:
    """Python attributes a diverging rank's keyframe holds otherwise than the majority's."""
    p = s.get("python_state_at_divergence")
    if not p:
        return []

    def shown(v: Any) -> str:
        return "unchanged since its first keyframe" if v is None else escape(repr(v))

    changes = "; ".join(f"{escape(str(c['name']))} {shown(c['rank'])} (rank {p['majority_rank']}: {shown(c['majority'])})"
                        for c in p["changes"])
    return [style(f"  rank {p['rank']}'s keyframe at step {p['keyframe']} holds Python state other than rank "
                  f"{p['majority_rank']}'s (at step {p['majority_keyframe']}): {changes}", fg="red")]


def _step_name(s: dict[str, Any]) -> str:
    steps = s.get("step_callables") or []
    return escape(str(steps[0]["step"])) if len(steps) == 1 and steps[0].get("step") else "MODULE:QUALNAME"


def _numerics_lines(n: dict[str, Any] | None, what: str = "numerics settings") -> list[str]:
    """The numerics settings (or plain arguments) of the diverging rank's step, where they
    differ from the majority's."""
    if not n:
        return []
    changes = "; ".join(f"{escape(str(c['name']))} {escape(str(c['rank']))} (rank {n['majority_rank']}: "
                        f"{escape(str(c['majority']))}), since step {c['since']}" for c in n["changes"])
    how = "ran step {} under other numerics settings".format(n["step"]) if what == "numerics settings" else \
        "called step {} with other arguments".format(n["step"])
    return [style(f"  rank {n['rank']} {how} than rank {n['majority_rank']}, the newest first: {changes}", fg="red")]


def _one_rank_lines(s: dict[str, Any]) -> list[str]:
    # One rank: nothing was compared across ranks, as the verdict line (the first) says already.
    lines = []
    if s.get("output_fields") is False and any(int(r.get("steps") or 0) for r in s["ranks"]):
        # Nor would a re-run of one of its steps compare anything: said before it is tried.
        lines.append("nothing to compare a re-run with: the steps recorded no output or token field, only what "
                     f"went into them; {OUTPUT_REMEDY}")
    return lines


def _difference_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    for td in s.get("tuner_differences", []):
        lines.append(f"tuner choice differs     {escape(td['op'])}: "
                     + ", ".join(f"r{r} {escape(c or 'default')}" for r, c in td["choices"].items()))
    for kd in s.get("kernel_differences", []):
        lines.append(f"graph kernels differ     {escape(kd['key'])}: {_kernel_difference(kd)}")
    return lines


def _kernel_difference(kd: dict[str, Any]) -> str:
    only = "; ".join(f"rank {r} only: {escape(', '.join(v[:4]))}{' ...' if len(v) > 4 else ''}" for r, v in kd["only_on"].items())
    groups: dict[str, list[str]] = {}
    for r, k in kd.get("at_first_difference", {}).items():
        groups.setdefault(str(k), []).append(r)
    where = f"first difference at kernel #{kd.get('first_difference')}: " + "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(rs)} {escape(k)}" for k, rs in groups.items())
    return where + (f" ({only})" if only else "")
