"""A command, declared once: each module in ampctl/commands holds one COMMAND record (its name, its line in
`ampctl --help`, how it runs, its config schema and check, its Python API function). The router's table, `ampctl
--help`, shell completion, the schemas Hydra composes, the checks Hydra's callbacks run and `ampctl.<name>()` are
all read from the records that registry() finds, so a new command is its module, its YAML and its study
(docs/architecture.md; tests/integration/test_new_command.py adds one)."""

from __future__ import annotations

import enum
import functools
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import argparse

    from omegaconf import DictConfig

COMMANDS_PACKAGE = "ampctl.commands"


class Section(enum.Enum):
    """Where `ampctl --help` lists a command, in this order."""

    RUN = "run"
    STUDY = "study"
    FILES = "files"
    SETUP = "setup"


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # its line in `ampctl --help`
    section: Section
    # what the router runs with sys.argv set to what follows the command word: a @hydra.main app (Hydra's flags,
    # -m, --cfg, run directories) or, for a command of its own, a plain function
    main: Callable[[], Any]
    # ampctl.<name>(...): the command from Python, returning an ampctl.Result (None: a command for the terminal)
    api: Optional[Callable[..., Any]] = None
    # a Hydra app's primary config schema, stored for its YAML (conf/schema.app_schema_name)
    schema: Optional[type] = None
    check: Optional[Callable[["DictConfig"], None]] = None  # a job's typed config, checked before any job runs
    # a command of its own's arguments: its argparse parser (OneLineArgumentParser), from which its --help, its
    # one-line refusals and its shell completion come (shell/completion.from_its_parser: an argument's choices, or
    # its `completer` as argcomplete names it; none: the shell's file names)
    arguments: Optional[Callable[[], "argparse.ArgumentParser"]] = None
    # a run's plan from its typed config and Hydra's node, where it is more than the checked config and its choices
    # (train: a resumed run's own config, its checkpoint, its policy: runner/plan.py)
    plan: Optional[Callable[["DictConfig", "DictConfig"], Any]] = None
    # a single run's claim of its directory, before Hydra writes into it (None: a directory of its own alone,
    # runner/ownership.refuse_another_commands_directory); train's admits the run it resumes
    claim_directory: Optional[Callable[["DictConfig", str], None]] = None
    # its runs span torchrun's processes: the ranks other than 0 record nothing of their own (run.dir=.), and
    # each process leaves as a torchrun worker does (processes.exit_worker)
    spans_torchrun_ranks: bool = False
    # `-m ... resume=auto` continues the sweep its directory holds, with that sweep's own command line
    continues_sweeps: bool = False
    # a study's record in its directory (<record>.json: what its Python API returns, and what `ampctl report` finds
    # there), and how `ampctl report` renders it again: (the directory, a rich console) -> the failed runs in it
    record: Optional[str] = None
    rerender: Optional[Callable[[Path, Any], Optional[int]]] = None
    # the other commands whose configs its study composes (advise repairs a mode with a diff): their schemas are
    # stored with its own
    composes: tuple[str, ...] = ()

    @property
    def is_hydra_app(self) -> bool:
        return hasattr(self.main, "__wrapped__")  # hydra.main wraps the task function (functools.wraps)


@functools.lru_cache(maxsize=None)
def registry() -> dict[str, Command]:
    """Every command, in `ampctl --help`'s order (by section, then name): the COMMAND of each module of
    ampctl/commands. Imported by name, as Hydra instantiates a `_target_`: the shell sits below the commands."""
    package = importlib.import_module(COMMANDS_PACKAGE)
    found: list[Command] = []
    for module in pkgutil.iter_modules(package.__path__):
        command = getattr(importlib.import_module(f"{COMMANDS_PACKAGE}.{module.name}"), "COMMAND", None)
        if isinstance(command, Command):
            found.append(command)
    order = list(Section)
    return {c.name: c for c in sorted(found, key=lambda c: (order.index(c.section), c.name))}


def lazily(target: str) -> Callable[..., Any]:
    """`package.module:function`, imported when it is first called: a study's module imports torch, which --help
    and completion do not."""
    module, _, function = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), function)(*args, **kwargs)

    return call


def rerenderable() -> dict[str, Command]:
    """The commands `ampctl report` renders again, by their record's file name, in the registry's order."""
    return {f"{c.record}.json": c for c in registry().values() if c.record is not None and c.rerender is not None}


def command_named(name: str) -> Command:
    """The command `name` (KeyError: none). Its own module first (ampctl/commands/<name>.py), so that running one
    command imports no other's; the registry for one whose module is named otherwise."""
    module_name = f"{COMMANDS_PACKAGE}.{name}"
    try:
        command = getattr(importlib.import_module(module_name), "COMMAND", None)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        command = None
    if isinstance(command, Command) and command.name == name:
        return command
    return registry()[name]
