"""Whether a Python file's top level runs a program: read (parsed), never run.

A re-run imports the module a recording names (its step's class, its factory). A module that is
a script — its decode loop at the top level, not under ``if __name__ == "__main__":`` — would run
that loop inside replay when imported: the program's whole run, its files written, its exit or its
``os.kill`` taking replay down with it. Such a module is refused before it is imported.

What counts as running a program: a loop (``for``, ``while``) or a ``with`` block at the top level,
or a bare call of a function the module itself defines (``main()``) or of an exit (``sys.exit``,
``os._exit``, ``os.kill``). Definitions, imports, assignments and calls that compute a value
(``torch.manual_seed(0)``, ``log = getLogger()``) are not. The ``__main__`` guard's body is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["program_statement"]

_EXITS = {"exit", "quit", "_exit", "kill", "abort"}
_MAX_BYTES = 4 << 20  # a larger file is not looked into


def _is_main_guard(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements the module runs at import: its top level, and the bodies of top-level
    ``if`` (but the ``__main__`` guard) and ``try`` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if not _is_main_guard(node):
                out += _statements(node.body) + _statements(node.orelse)
        elif isinstance(node, ast.Try):
            out += _statements(node.body) + _statements(node.orelse) + _statements(node.finalbody)
        else:
            out.append(node)
    return out


def program_statement(path: Path) -> str | None:
    """``"a for loop (line 17)"`` when the file's top level runs a program; None when it does
    not, or when it cannot be read or parsed (the import then says what it says)."""
    try:
        if path.stat().st_size > _MAX_BYTES:
            return None
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in _statements(tree.body):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return f"a for loop (line {node.lineno})"
        if isinstance(node, ast.While):
            return f"a while loop (line {node.lineno})"
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return f"a with block (line {node.lineno})"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            called = _called_name(node.value)
            if called in _EXITS or (isinstance(node.value.func, ast.Name) and called in defined):
                return f"a call of {called}() (line {node.lineno})"
    return None
