"""The package's layers import only downward: the engine (the step and what it needs) never reaches up into
the runner, the instruments, the reports, the commands or the terminal UI."""

from __future__ import annotations

import ast
from pathlib import Path

import ampctl

PACKAGE = Path(ampctl.__file__).parent
ABOVE_THE_ENGINE = ("ampctl.runner", "ampctl.analysis", "ampctl.reports", "ampctl.commands", "ampctl.cli", "rich")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_the_engine_imports_nothing_above_it():
    files = sorted((PACKAGE / "engine").rglob("*.py"))
    assert len(files) >= 10
    offending = {f"{path.relative_to(PACKAGE)}: {module}" for path in files for module in imported_modules(path)
                 if module.startswith(ABOVE_THE_ENGINE)}
    assert not offending, sorted(offending)


def test_no_module_shadows_the_standard_library():
    import sys

    names = {path.stem for path in PACKAGE.rglob("*.py")} - {"__init__", "__main__", "io"}
    # io.py is ampctl.io, only ever imported by its full name; the design names it so
    assert not names & set(sys.stdlib_module_names)
