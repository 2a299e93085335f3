"""Steps whose signatures are not plain parameters: ``*args`` (alone or mixed with positional,
keyword-only and ``**kwargs`` parameters), positional-only parameters, and ``@staticmethod`` /
``@classmethod`` steps. Each records and re-runs as it was called."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from replay.core.structure import POSITIONAL_ARG, STRUCTURE_ARG, call_arguments, rebuild_inputs
from replay.numerics import strip_reserved
from replay.record.calls import split_arguments
from tests.test_newcomer_scripts import _replay, _script


def _round_trip(fn: Any, *args: Any, skip_first: bool = False, **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Record a call's arguments as the recorder does and call ``fn`` again from them as a re-run
    does (what ``fn`` received both times)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    tensors, scalars = split_arguments(bound, skip_first=skip_first)
    scalars = json.loads(json.dumps(scalars))  # as stored
    inputs = rebuild_inputs(dict(tensors), scalars.get(STRUCTURE_ARG), scalars.get(POSITIONAL_ARG))
    call_args, call_kwargs = call_arguments({**inputs, **strip_reserved(scalars)}, scalars.get(POSITIONAL_ARG))
    if skip_first:
        call_args = [args[0], *call_args]
    return call_args, call_kwargs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_var_positional_items_are_passed_back_by_position() -> None:
    """``forward(self, *args)`` with a tensor, an int, a list of tensors, None and a float: the
    re-run's call gets the same items, by position (before, ``args=`` was passed as a keyword)."""
    class AR:
        def forward(self, *args: Any) -> Any:
            return args

    t, c0, c1 = torch.arange(2), torch.zeros(2, 3), torch.ones(2, 3)
    me = AR()
    args, kwargs = _round_trip(AR.forward, me, t, 4, [c0, c1], None, 0.25, skip_first=True)
    assert kwargs == {}
    assert _same(AR.forward(*args, **kwargs), (t, 4, [c0, c1], None, 0.25))


def test_positional_var_positional_keyword_only_and_var_keyword_mixed() -> None:
    """``f(ids, pos, *rest, scale, **extra)``: ``ids`` and ``pos`` by position before ``*rest``,
    ``scale`` and ``extra``'s items by keyword; nested containers (a tuple of tuples) in ``*rest``."""
    def f(ids: Any, pos: int, *rest: Any, scale: float, **extra: Any) -> Any:
        return ids, pos, rest, scale, extra

    ids, k, v, m = torch.tensor([3, 1]), torch.randn(2, 4), torch.randn(2, 4), torch.ones(2)
    call = (ids, 7, ((k, v), (k, None)), {"a": m}, "greedy")
    args, kwargs = _round_trip(f, *call, scale=0.5, mask=m, note="x")
    assert _same(f(*args, **kwargs), (ids, 7, call[2:], 0.5, {"mask": m, "note": "x"}))


def test_positional_only_parameters_are_passed_by_position() -> None:
    def f(x: Any, y: Any, /, z: Any = 1) -> Any:
        return x, y, z

    a, b = torch.ones(2), torch.zeros(3)
    args, kwargs = _round_trip(f, a, b, z=2)
    assert _same(f(*args, **kwargs), (a, b, 2))

    # A step called by its parameters' names records what it did before (no ``__positional__``).
    def g(x: Any, pos: int, cache: Any = None, **kw: Any) -> Any:
        return x

    _, scalars = split_arguments(inspect.signature(g).bind(a, 3, [b], extra=1), skip_first=False)
    assert POSITIONAL_ARG not in scalars


def test_a_graphed_step_gets_its_var_positional_arguments_by_position() -> None:
    """``GraphedStep`` (``--mode cudagraph`` without the engine's own graph runner) calls the
    target's step with keywords only: what sits behind it passes ``*args`` by position."""
    from replay.rerun.runner import _CallAsRecorded

    seen: list[Any] = []

    def forward(ids: Any, *args: Any, scale: float) -> None:
        seen.append((ids, args, scale))

    t = torch.ones(2)
    step = _CallAsRecorded(forward)
    step(**{"ids": t, "args.0": 3, "args.1": None, "scale": 0.5, POSITIONAL_ARG: ["ids", "args.0", "args.1"]})
    step(ids=t, scale=1.0)  # a call recorded with keywords only is passed on as it is
    assert _same(seen, [(t, (3, None), 0.5), (t, (), 1.0)])


def test_a_graphed_step_writes_back_into_its_arguments_except_an_expanded_one() -> None:
    """What a graph replay wrote into its static copy goes back into the caller's tensor; an
    ``expand``ed argument (which no eager step can write into) is left alone, never an error."""
    from replay.rerun.graphs import _write_back

    out, wrote = torch.zeros(2, 3), torch.arange(6.0).view(2, 3)
    _write_back(out, wrote)
    assert torch.equal(out, wrote)
    shared = torch.zeros(3).expand(2, 3)
    _write_back(shared, wrote)
    assert torch.equal(shared, torch.zeros(2, 3))


_VARARGS = """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    V, D, T = 50, 16, 12

    class LM(nn.Module):
        def __init__(s):
            super().__init__(); s.emb = nn.Embedding(V, D); s.qkv = nn.Linear(D, 3 * D); s.head = nn.Linear(D, V)
        def run(s, ids, pos, cache, mask=None, scale=1.0):
            x = s.emb(ids); q, k, v = s.qkv(x).chunk(3, -1)
            cache[0][:, pos] = k; cache[1][:, pos] = v
            a = torch.softmax(torch.einsum('bd,btd->bt', q, cache[0][:, :pos + 1]) * scale, -1)
            return s.head(x + torch.einsum('bt,btd->bd', a, cache[1][:, :pos + 1]))

    class AR(LM):
        def forward(self, *args):
            return self.run(*args)

    class Mixed(LM):
        def forward(self, ids, *rest, scale, **extra):
            return self.run(ids, *rest, mask=extra.get("mask"), scale=scale)

    mixed = sys.argv[1:] == ["mixed"]
    m = (Mixed if mixed else AR)().eval()
    cache = [torch.zeros(2, T, D), torch.zeros(2, T, D)]
    tok = torch.tensor([1, 2])
    with torch.no_grad():
        for pos in range(7):
            lg = m(tok, pos, cache, scale=D ** -0.5, mask=None) if mixed else m(tok, pos, cache, None, D ** -0.5)
            tok = lg.argmax(-1)
    print(tok.tolist())
"""


@pytest.mark.e2e
@pytest.mark.smoke
@pytest.mark.parametrize("mode", ["args", "mixed"])
def test_a_forward_taking_var_positional_arguments_re_runs(tmp_path: Path, mode: str) -> None:
    """``forward(self, *args)`` (and ``forward(self, ids, *rest, scale, **extra)``), found with
    no flags, re-runs bit for bit inside the re-launched program: before, every re-run raised
    ``TypeError: AR.forward() got an unexpected keyword argument 'args'``."""
    _script(tmp_path, "varargs", _VARARGS)
    rec = _record_with_arg(tmp_path, mode)
    p = _replay("step", rec, "--rank", 0, "--step", 3, "--no-save", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.startswith("reproduced"), p.stdout


def _record_with_arg(tmp: Path, mode: str) -> Path:
    """``replay record -- python varargs.py MODE`` (``_record`` passes the script no arguments)."""
    out = tmp / f"rec-varargs-{mode}"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "varargs.py", mode, cwd=tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


_BINDINGS = """
    import sys, torch
    torch.manual_seed(0)
    V, D = 40, 16
    W = {"emb": torch.randn(V, D), "w1": torch.randn(D, D) / D ** 0.5, "head": torch.randn(D, V) / D ** 0.5}

    def decode(W, tok, h):
        h = torch.tanh((W["emb"][tok] + h) @ W["w1"]); return h @ W["head"], h

    class Engine:
        W = W
        @staticmethod
        def sstep(tok, h): return decode(Engine.W, tok, h)
        @classmethod
        def cstep(cls, tok, h): return decode(cls.W, tok, h)

    step = Engine.sstep if sys.argv[1] == "static" else Engine().cstep  # a classmethod through an instance too
    tok = torch.tensor([1, 2]); h = torch.zeros(2, D)
    for i in range(8):
        lg, h = step(tok, h)
        tok = lg.argmax(-1)
    print(tok.tolist())
"""


@pytest.mark.e2e
@pytest.mark.smoke
@pytest.mark.parametrize("binding, method", [("static", "sstep"), ("class", "cstep")])
def test_static_and_class_method_steps_are_one_part_and_re_run(tmp_path: Path, binding: str, method: str) -> None:
    """``--step engine:Engine.sstep`` (a staticmethod) and ``Engine.cstep`` (a classmethod): one
    part of 8 steps (before, a staticmethod's first argument was taken as its object, so each
    call was a part of its own), and a re-run that finds the function in the re-launched program
    and reproduces bit for bit (before: "cannot find the function of Engine.sstep")."""
    import sys

    _script(tmp_path, "engine", _BINDINGS)
    out = tmp_path / f"rec-{binding}"
    p = _replay("record", "--quiet", "--out", out, "--step", f"engine:Engine.{method}", "--",
                sys.executable, "engine.py", binding, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    parts = sorted(d.name for d in out.iterdir() if d.is_dir() and d.name.startswith("run-"))
    assert parts == ["run-000"], parts
    info = json.loads(_replay("info", out, "--json", cwd=tmp_path).stdout)
    assert info["ranks"][0]["steps"] == 8, info["ranks"]
    for step in (0, 5):
        r = _replay("step", out, "--rank", 0, "--step", step, "--no-save", cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        assert r.stdout.startswith("reproduced") and "bit for bit" in r.stdout, r.stdout


_GRAPHED_VARARGS = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    V, D, T = 50, 16, 12

    class AR(nn.Module):
        def __init__(s):
            super().__init__(); s.emb = nn.Embedding(V, D); s.qkv = nn.Linear(D, 3 * D); s.head = nn.Linear(D, V)
        def forward(s, *args):  # (ids, pos, cache, logits): writes the logits, returns nothing
            ids, pos, cache, logits = args
            x = s.emb(ids); q, k, v = s.qkv(x).chunk(3, -1)
            cache[0][:, pos] = k; cache[1][:, pos] = v
            a = torch.softmax(torch.einsum('bd,btd->bt', q, cache[0][:, :pos + 1]) * D ** -0.5, -1)
            torch.matmul(x + torch.einsum('bt,btd->bd', a, cache[1][:, :pos + 1]), s.head.weight.T, out=logits)

    m = AR().cuda().eval()
    cache = [torch.zeros(2, T, D, device="cuda"), torch.zeros(2, T, D, device="cuda")]
    logits = torch.empty(2, V, device="cuda"); tok = torch.tensor([1, 2], device="cuda")
    with torch.no_grad():
        for pos in range(7):
            m(tok, pos, cache, logits)
            tok = logits.argmax(-1)
    print(tok.tolist())
"""


@pytest.mark.gpu
def test_cudagraph_mode_re_runs_a_var_positional_step_that_writes_into_its_arguments(tmp_path: Path) -> None:
    """``--mode cudagraph`` on a step of no graph runner of its own (``GraphedStep``), taking
    ``*args`` with a KV cache as a list and writing its logits into an ``out=`` buffer: the
    graphed re-run gets its arguments by position, the list's tensors as this step's, and is
    compared on what it wrote (before, on the static copies' inputs: never reproduced)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _script(tmp_path, "graphed", _GRAPHED_VARARGS)
    out = tmp_path / "rec-graphed"
    p = _replay("record", "--quiet", "--out", out, "--", sys.executable, "graphed.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    for mode in ("eager", "cudagraph"):
        r = _replay("step", out, "--rank", 0, "--step", 4, "--mode", mode, "--device", "cuda", "--no-save", "--json", cwd=tmp_path)
        assert r.returncode == 0, mode + r.stdout + r.stderr[-2000:]
        run = json.loads(r.stdout)["modes"][mode]
        verdicts = {k: v["verdict"] for k, v in run["vs_recording"].items()}
        assert verdicts and set(verdicts.values()) == {"bitwise equal"}, (mode, verdicts)
        assert run["departed"] is None, (mode, run)
