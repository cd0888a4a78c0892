"""A command's config composed outside a Hydra app (ampctl list, the Python API), exactly as the app would
compose it: ampctl's configs, and a `-cd` directory where Hydra puts a command line's config dir. The one module
that reaches into Hydra's private API (hydra._internal): its public compose API covers everything else, but not
a `-cd` directory beside an app's configs (tests/integration/test_hydra_behaviours.py pins that the two agree),
nor a copy of its config repository that leaves the ConfigStore uncopied (share_one_config_store, pinned there too).
No other module of ampctl reaches into Hydra's internals or patches a library's class."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

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


def register_schemas(names: Optional[Iterable[str]] = None) -> None:
    """The app schemas of these commands (every command's: None) stored where Hydra composes their YAML."""
    from ampctl.conf.schema import register_configs
    from ampctl.shell.command import command_named, registry

    share_one_config_store()
    commands = [command_named(name) for name in names] if names is not None else list(registry().values())
    commands += [command_named(other) for command in commands for other in command.composes]
    register_configs({c.name: c.schema for c in commands if c.schema is not None})


def put_config_dir_on_path(args: list[str]) -> None:
    """Modules beside the configs of `-cd DIR` are importable (a recipe's `_target_: my_recipe.Recipe`), as
    the directory of a script Python runs is: a user's experiment directory works without PYTHONPATH."""
    from ampctl.conf.config_dirs import make_importable

    value = hydra_flags(args)[0].get("config_dir")
    if value:
        make_importable([value])


# Hydra's flags that take a value, and those that take none (its parser's: pinned in
# tests/integration/test_hydra_behaviours.py): what is left of a command line is its overrides
_FLAGS_WITH_VALUE = {"-cd": "config_dir", "--config-dir": "config_dir", "-cn": "config_name",
                     "--config-name": "config_name", "-c": "cfg", "--cfg": "cfg",
                     "-p": "package", "--package": "package",
                     "--info": "info", "-i": "info", "-sc": "shell_completion",
                     "--shell-completion": "shell_completion",
                     "--experimental-rerun": "rerun", "-cp": "config_path", "--config-path": "config_path"}
_FLAGS = {"-m": "multirun", "--multirun": "multirun", "-r": "run", "--run": "run", "--resolve": "resolve", "-h": "help",
          "--help": "help", "--hydra-help": "hydra_help", "--version": "version"}


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


def share_one_config_store() -> None:
    """Hydra deep-copies its config repository before it searches it (its CachingConfigRepository, so that
    initialize_sources leaves the original alone), and with it the ConfigStore singleton its structured source
    holds: once a composition, and once for each config group that --help, shell completion and `ampctl list`
    list (~20 ms a copy of ampctl's schemas: `ampctl memory --help` took 1.6 s without this, 0.44 s with it, on 2
    cores where `import torch` took 2.0 s). The store is only read through a copy (ConfigStore.load copies each
    node it gives out), and Hydra since its pull request 2928 reads the singleton itself: a copy of the store is the
    store. Both pinned in tests/integration/test_hydra_behaviours.py; the one class ampctl patches."""
    from hydra.core.config_store import ConfigStore

    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = lambda store, _memo: store  # type: ignore[attr-defined]


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
