"""The architecture, checked: no function too complex to change safely, and no import that
points up a layer (docs/architecture.md draws the layers). Reads the source with ``ast``; runs in
about a second and needs nothing installed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "replay"
MAX_COMPLEXITY = 20

# Functions above MAX_COMPLEXITY that may stay for now (name -> the number they may not grow
# past). Empty: every function in replay/ is at or under the limit; a new offender is split, never
# listed here.
ALLOWED_COMPLEXITY: dict[str, int] = {}


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bootstrap" in path.parts:
            continue  # sitecustomize for recorded processes: no package imports by design
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text(encoding="utf-8"), str(path))


# -- complexity -----------------------------------------------------------------------------

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of functions or classes defined inside it (they are
    counted on their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, _DEFS):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def complexity(fn: ast.AST) -> int:
    """Cyclomatic complexity as radon counts it: 1, plus one per branch (``if``/``elif``, loop,
    ``except``, conditional expression, ``case``), per extra operand of ``and``/``or``, and per
    ``for``/``if`` clause of a comprehension."""
    n = 1
    for node in _own_nodes(fn):
        if isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.IfExp, ast.match_case)):
            n += 1
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
    return n


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def all_complexities() -> dict[str, int]:
    out = {}
    for _, path, tree in _modules():
        rel = path.relative_to(ROOT).as_posix()
        for qual, fn in _functions(tree):
            out[f"{rel}::{qual}"] = complexity(fn)
    return out


def test_the_counter_counts_what_it_says() -> None:
    src = """
def f(xs):
    if xs and xs[0] or not xs:      # if +1, and/or +2
        return [x for x in xs if x]  # comprehension for +1, its if +1
    for x in xs:                     # +1
        try:
            pass
        except ValueError:           # +1
            pass
    def inner(y):                    # counted on its own
        return 1 if y else 2
    return 0 if xs else 1            # +1
"""
    fns = dict(_functions(ast.parse(src)))
    assert complexity(fns["f"]) == 1 + 3 + 2 + 1 + 1 + 1
    assert complexity(fns["f.inner"]) == 2


def test_no_function_is_too_complex() -> None:
    found = all_complexities()
    over = {k: v for k, v in found.items() if v > MAX_COMPLEXITY and v > ALLOWED_COMPLEXITY.get(k, MAX_COMPLEXITY)}
    assert not over, (f"functions above cyclomatic complexity {MAX_COMPLEXITY} (split them into named steps): "
                      + ", ".join(f"{k} ({v})" for k, v in sorted(over.items())))
    missing = [k for k in ALLOWED_COMPLEXITY if k not in found]
    assert not missing, f"allow-listed functions that no longer exist (remove them from ALLOWED_COMPLEXITY): {missing}"


# -- layers ---------------------------------------------------------------------------------


def _imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every module a file imports, at any depth (lazy imports inside functions count too), as
    (line, dotted name); ``from a import b`` gives both ``a`` and ``a.b``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for a in node.names:
                yield node.lineno, f"{node.module}.{a.name}"


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# (importer packages, forbidden packages, why)
CONTRACTS: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("replay.format",), ("replay.record", "replay.rerun", "replay.cli", "replay.bisect", "replay.report", "replay.api",
                          "replay.analysis"), "the on-disk format is the bottom layer: it reads and writes files only"),
    (("replay.analysis",), ("replay.record", "replay.rerun", "replay.cli", "replay.bisect", "replay.report", "replay.api"),
     "analysis reads recordings; it never records, re-runs or prints"),
    (("replay.record", "replay.rerun", "replay.bisect", "replay.report", "replay.analysis", "replay.format", "replay.api"),
     ("replay.cli",), "the library never imports the command line"),
    (("replay.core",), ("replay.record", "replay.rerun", "replay.cli", "replay.bisect", "replay.report", "replay.api",
                        "replay.analysis", "replay.format"), "core is the vocabulary below record and rerun"),
    (("replay.rerun",), ("replay.record",), "a re-run shares vocabulary with the recorder through replay.core only"),
    (tuple(f"replay.{p.name.removesuffix('.py')}" for p in PACKAGE.iterdir()
           if p.name not in ("workloads", "__pycache__", "__init__.py", "__main__.py")),
     ("replay.workloads",), "the reference workload is a user of replay, not part of it"),
]

# Known edges that break a contract today, in files other helpers own; removed when fixed.
ALLOWED_IMPORTS: set[tuple[str, str]] = set()

# CLI modules shared by the commands; any other replay.cli module is a command, and a command
# never imports another (what two commands share goes down into the library).
CLI_SHARED = {"replay.cli", "replay.cli.common", "replay.cli.render", "replay.cli.progress", "replay.cli.info_text"}
ALLOWED_CLI_SIBLINGS: set[tuple[str, str]] = set()  # none: shared rendering lives in the CLI_SHARED modules


def test_imports_point_down_the_layers() -> None:
    bad = []
    for mod, path, tree in _modules():
        for line, name in _imports(tree):
            for importers, forbidden, why in CONTRACTS:
                if _under(mod, *importers) and _under(name, *forbidden) and (mod, name) not in ALLOWED_IMPORTS:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}: {why}")
    assert not bad, "\n".join(bad)


def test_no_command_imports_another() -> None:
    bad = []
    for mod, path, tree in _modules():
        if not _under(mod, "replay.cli") or mod in CLI_SHARED or mod == "replay.cli.main":
            continue
        for line, name in _imports(tree):
            if _under(name, "replay.cli") and name not in CLI_SHARED and not name.startswith(tuple(s + "." for s in CLI_SHARED)):
                if (mod, name) not in ALLOWED_CLI_SIBLINGS and (mod, name.rsplit(".", 1)[0]) not in ALLOWED_CLI_SIBLINGS:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "a command imports another command's module (move what they share into the library):\n" + "\n".join(bad)


def test_the_version_comes_from_one_place() -> None:
    bad = []
    for mod, path, tree in _modules():
        if mod in ("replay", "replay._version"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "replay" and any(a.name == "__version__" for a in node.names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if (isinstance(node, ast.Attribute) and node.attr == "__version__" and isinstance(node.value, ast.Name)
                    and node.value.id == "replay"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "read the version from replay._version, not the package root: " + ", ".join(bad)


@pytest.mark.parametrize("contract", range(len(CONTRACTS)), ids=["format", "analysis", "no-cli", "core", "rerun-not-record", "no-workloads"])
def test_each_contract_can_fail(contract: int) -> None:
    """The checks see a forbidden import when there is one (a check that cannot fail checks nothing)."""
    importers, forbidden, _ = CONTRACTS[contract]
    tree = ast.parse(f"def f():\n    from {forbidden[0]} import x\n")
    assert any(_under(importers[0], *importers) and _under(n, *forbidden) for _, n in _imports(tree))
