"""The package's layers import only downward: the engine (the step and what it needs) never reaches up into
the runner, the instruments, the reports, the commands or the terminal UI."""

from __future__ import annotations

import ast
from pathlib import Path

import ampctl

PACKAGE = Path(ampctl.__file__).parent
ABOVE_THE_ENGINE = ("ampctl.runner", "ampctl.analysis", "ampctl.reports", "ampctl.studies", "ampctl.shell",
                    "ampctl.commands",
                    "ampctl.cli", "rich")


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


# Bottom to top; a package imports only from its own layer and those below (function-level imports included).
LAYERS = (
    ("ampctl.errors", "ampctl.io", "ampctl.processes", "ampctl.preloaded_server", "ampctl.preloaded",
     "ampctl.machine_load", "ampctl.interrupt", "ampctl.run_files",
     "ampctl.conf", "ampctl.version", "ampctl.__init__"),
    ("ampctl.recipes",),
    ("ampctl.engine",),
    ("ampctl.reports",),  # run dirs, tables, plots: rendering that the instruments and the runner use
    ("ampctl.analysis",),
    ("ampctl.runner",),
    ("ampctl.studies",),  # compare, inspect, memory: studies that run the engine (and the runner) many times
    # the shell around Hydra: the command record, Hydra's callbacks, a command's ways out, Hydra's internals
    ("ampctl.shell",),
    ("ampctl.commands",),  # one module per command, each declaring its COMMAND record
    ("ampctl.cli", "ampctl.__main__", "ampctl.api"),
)
# The package's front door: `ampctl.train(...)` re-exports the Python API, imported on first use only.
FRONT_DOOR = {("ampctl.__init__", "ampctl.api")}


def layer_of(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer")


def package_modules() -> dict[str, Path]:
    """Every module by name (its import path is its file's path)."""
    return {".".join(["ampctl", *path.relative_to(PACKAGE).with_suffix("").parts]): path
            for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_package_imports_only_from_its_layer_and_below():
    modules = package_modules()
    assert "ampctl.conf.schema" in modules and "ampctl.engine.loop" in modules
    upward = [f"{name} imports {module}" for name, path in modules.items() for module in imported_modules(path)
              if module.startswith("ampctl.") and layer_of(module) > layer_of(name)
              and (name, module) not in FRONT_DOOR]
    assert not upward, upward


def test_no_module_imports_itself_through_others():
    modules = package_modules()
    imports = {name: imported_modules(path) for name, path in modules.items()}
    graph = {name: {m for m in modules if any(i == m or i.startswith(m + ".") for i in imports[name])} - {name}
             for name in modules}
    graph = {name: {m for m in deps if not name.startswith(m + ".") and m not in ("ampctl", "ampctl.conf")}
             for name, deps in graph.items()}  # a package's __init__ is not a cycle of its own modules

    done: set[str] = set()

    def cycle_through(node: str, path: list[str]) -> list[str]:
        """A cycle reachable from node (depth first; each module explored once)."""
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = cycle_through(nxt, path + [nxt])
                if found:
                    return found
        done.add(node)
        return []

    cycles = [c for name in sorted(modules) if name not in done for c in [cycle_through(name, [name])] if c]
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_front_ends_do_not_import_each_other():
    """The command line (cli) and the Python API (api) share what lies below them, never each other."""
    modules = package_modules()
    assert not {m for m in imported_modules(modules["ampctl.api"]) if m.startswith("ampctl.cli")}
    assert not {m for m in imported_modules(modules["ampctl.cli"]) if m.startswith("ampctl.api")}
    assert "sys.modules" not in modules["ampctl.cli"].read_text()  # values are handed over, not fetched
