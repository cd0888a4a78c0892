"""The size limits the house keeps (issue 36): no function over 60 lines or with more than 8 parameters, no module
over 400 lines, and Hydra's private API reached from one module only. A change that crosses one splits the
code instead of raising the limit."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import ampctl

PACKAGE = Path(ampctl.__file__).parent
MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_MODULE_LINES = 60, 8, 400


@functools.cache
def modules() -> dict[Path, ast.Module]:
    """Every module of the package, parsed once for all the checks."""
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def functions():
    for path, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE), node


def parameters(node: ast.FunctionDef) -> int:
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return len([a for a in named if a.arg not in ("self", "cls")])


def test_no_function_is_over_60_lines_or_takes_more_than_8_parameters():
    long = [f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path, node in functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    many = [f"{path}:{node.lineno} {node.name}: {parameters(node)} parameters"
            for path, node in functions() if parameters(node) > MAX_PARAMETERS]
    assert not long and not many, long + many


def test_no_module_is_over_400_lines():
    sizes = {path.relative_to(PACKAGE): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 100
    assert not {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}


def test_hydras_private_api_is_imported_by_one_module():
    importers = set()
    for path, tree in modules().items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.startswith("hydra._internal") for name in names):
                importers.add(str(path.relative_to(PACKAGE)))
    assert importers == {"commands/hydra_internals.py"}
