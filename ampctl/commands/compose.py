"""A command's config composed outside a Hydra app (ampctl list, the Python API), exactly as the app would
compose it: ampctl's configs, with a `-cd` directory first, as Hydra puts a command line's config dir."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from hydra.types import RunMode
from omegaconf import DictConfig


def config_loader(config_dir: Optional[Path]):
    """Hydra's config loader over pkg://ampctl.conf, with config_dir first (Hydra prepends a command line's
    config dir to the app's search path). Hydra's own class: Hydra has no public API for a loader."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    search_path = create_config_search_path("pkg://ampctl.conf")
    if config_dir is not None:
        search_path.prepend("command-line", f"file://{Path(config_dir).resolve()}")
    return ConfigLoaderImpl(config_search_path=search_path)


@contextlib.contextmanager
def composed(config_name: str, overrides: Sequence[str], config_dir: Optional[Path] = None) -> Iterator[DictConfig]:
    """The composed config with its hydra node (run dir, choices, overrides), as a single run of the command
    sees it; Hydra is initialized meanwhile (compare composes each mode through it), and cleared after."""
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from ampctl.conf.schema import register_configs

    register_configs()
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
