"""A command's config composed outside a Hydra app (ampctl list, the Python API), exactly as the app would
compose it: ampctl's configs, and a `-cd` directory where Hydra puts a command line's config dir. The one module
that reaches into Hydra's private API (hydra._internal): its public compose API covers everything else, but not
a `-cd` directory beside an app's configs (tests/integration/test_hydra_behaviours.py pins that the two agree),
nor an app's start without the composition Hydra makes only to read hydra.mode (pinned there too)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from hydra.types import RunMode
from omegaconf import DictConfig


def config_loader(config_dir: Optional[Path]):
    """Hydra's config loader over pkg://ampctl.conf with config_dir where Hydra's app puts a command line's
    `-cd`: after the app's own configs, before the structured schemas (hydra/_internal/utils.py, run_hydra). So a
    user's file named like one of ampctl's does not replace it, in the app and here alike (pinned in
    tests/integration/test_hydra_behaviours.py). Hydra's own class: Hydra has no public API for a loader."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path("pkg://ampctl.conf")
    if config_dir is not None:
        search_path.prepend("command-line", f"file://{Path(config_dir).resolve()}",
                            anchor=SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path)


@contextlib.contextmanager
def composed(config_name: str, overrides: Sequence[str], config_dir: Optional[Path] = None) -> Iterator[DictConfig]:
    """The composed config with its hydra node (run dir, choices, overrides), as a single run of the command
    sees it; Hydra is initialized meanwhile (compare composes each mode through it), and cleared after."""
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from ampctl.shell.command import register_schemas

    register_schemas()
    search_path = config_loader(config_dir).config_search_path
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name=config_name, config_search_path=search_path)
    try:
        cfg = hydra.compose_config(config_name, list(overrides), run_mode=RunMode.RUN, from_shell=False)
        HydraConfig.instance().set_config(cfg)  # what the command's code reads through HydraConfig.get()
        yield cfg
    finally:
        GlobalHydra.instance().clear()


def put_config_dir_on_path(args: list[str]) -> None:
    """Modules beside the configs of `-cd DIR` are importable (a recipe's `_target_: my_recipe.Recipe`), as
    the directory of a script Python runs is: a user's experiment directory works without PYTHONPATH."""
    for i, arg in enumerate(args):
        value = None
        if arg in ("-cd", "--config-dir") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--config-dir="):
            value = arg.split("=", 1)[1]
        if value and os.path.isdir(value):
            sys.path.insert(0, os.path.abspath(value))
            os.environ["PYTHONPATH"] = os.pathsep.join(  # the processes compare and memory start see it too
                [os.path.abspath(value), *filter(None, [os.environ.get("PYTHONPATH")])])


# Hydra's flags that take a value, and those that take none: what is left of a command line is its overrides
_FLAGS_WITH_VALUE = {"-cd": "config_dir", "--config-dir": "config_dir", "-cn": "config_name",
                     "--config-name": "config_name", "-c": "cfg", "--cfg": "cfg",
                     "-p": "package", "--package": "package",
                     "--info": "info", "-i": "info", "-sc": "shell_completion",
                     "--shell-completion": "shell_completion",
                     "--experimental-rerun": "rerun", "-cp": "config_path", "--config-path": "config_path"}
_FLAGS = {"-m": "multirun", "--multirun": "multirun", "-r": "run", "--run": "run", "--resolve": "resolve", "-h": "help",
          "--help": "help", "-hh": "hydra_help", "--hydra-help": "hydra_help", "--version": "version"}


def hydra_flags(args: list[str]) -> tuple[dict[str, Optional[str]], list[str]]:
    """A Hydra app's command line as its flags (name -> value, None for a flag without one) and its overrides."""
    flags: dict[str, Optional[str]] = {}
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, _, value = arg.partition("=")
        if name in _FLAGS_WITH_VALUE and (value or name.startswith("--")) and "=" in arg:
            flags[_FLAGS_WITH_VALUE[name]] = value
        elif arg in _FLAGS_WITH_VALUE:
            flags[_FLAGS_WITH_VALUE[arg]] = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        elif arg in _FLAGS:
            flags[_FLAGS[arg]] = None
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


# Where a command line brings configs of the user's: a directory of theirs, a primary config or a search path
_USERS_CONFIGS = ("config_dir", "config_name", "config_path", "rerun")


@contextlib.contextmanager
def mode_read_from_the_command_line(args: list[str]) -> Iterator[None]:
    """Hydra composes an app's whole config once only to read hydra.mode from it (Hydra.get_mode), then again
    for the run (~0.15 s of CPU each on these 2 cores; Hydra's issue 3440). A command line that brings no config
    of the user's (no -cd, -cn, -cp, --experimental-rerun, hydra.searchpath) and sets no hydra.mode composes only
    ampctl's configs and Hydra's, none of which sets it (pinned in test_hydra_behaviours.py): its mode is None,
    which Hydra reads as its flags' (-m or not). Then get_mode answers that without composing; any other command
    line goes through Hydra's own."""
    from hydra._internal.hydra import Hydra

    flags, overrides = hydra_flags(args)
    if set(_USERS_CONFIGS) & set(flags) or any(
            override.lstrip("+~").startswith(("hydra.mode", "hydra.searchpath")) for override in overrides):
        yield
        return
    original = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = original  # type: ignore[method-assign]


def refuse_a_config_that_is_not_ampctls(command: str, app_config: str, args: list[str]) -> None:
    """`-cn NAME` whose config does not start from ampctl's app config (a --cfg job dump from before it wrote
    its defaults list, a config of one's own without `- train`): Hydra would run it without ampctl's callbacks,
    so without the check that a run directory is the run's own (it overwrote an earlier run's records), and
    with Hydra's default run directories and logging. Refused in one line; a config Hydra cannot compose is
    left to Hydra's own message."""
    from omegaconf import OmegaConf

    from ampctl.errors import UsageError

    flags, overrides = hydra_flags(args)
    name = flags.get("config_name")
    if not name or name == app_config or {"help", "hydra_help", "cfg", "info", "shell_completion"} & set(flags):
        return
    config_dir = flags.get("config_dir")
    try:
        with composed(name, overrides, Path(config_dir) if config_dir else None) as cfg:
            ours = OmegaConf.select(cfg, "hydra.callbacks.check_every_job") is not None
    except Exception:  # noqa: BLE001 - Hydra's run says what is wrong with it, in its one line
        return
    if not ours:
        raise UsageError(f"-cn {name}: the config does not start from ampctl's {app_config} config, so ampctl's "
                         "checks (a value it refuses, a run directory that holds another run), its run directories "
                         f"and its logging would not apply; begin it with `defaults: [{app_config}, _self_]` (and "
                         f"`override <group>: <option>` for the options it uses), as `ampctl {command} --cfg job` "
                         "writes it")
