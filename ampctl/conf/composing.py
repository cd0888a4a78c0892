"""A job's config composed inside a running Hydra app (compare's modes, memory's rows, a sweep's jobs checked
before the first starts): Hydra's compose with the app's own search path (`-cd` included), a failure the
command line's one line."""

from __future__ import annotations

import copy
from typing import Any

from hydra import compose
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from ampctl.conf.messages import one_line
from ampctl.errors import UsageError


def compose_job(config_name: str, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """with_hydra: the hydra node too (the group choices, hydra.runtime.choices)."""
    try:
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None


def precision_node(name: str, key: str = "precision.schedule") -> dict[str, Any]:
    """A mode of the precision group as Hydra composes it (the app's search path: a -cd directory's modes too), for
    a config that names one as a value (precision.schedule's changes); in a running Hydra app or the Python API."""
    from hydra.core.global_hydra import GlobalHydra

    from ampctl.conf.messages import did_you_mean

    if not GlobalHydra.instance().is_initialized():
        raise UsageError(f"{key} names precision={name}: its mode is composed by Hydra when the run is planned; plan "
                         "it with ampctl's commands or the Python API (ampctl.train)")
    options = GlobalHydra.instance().config_loader().get_group_options("precision")
    if name not in options:
        raise UsageError(f"{key}: {name!r} is not a precision mode{did_you_mean(name, options)}; choose from "
                         f"{', '.join(options)}")
    node = compose_job("train", [f"precision={name}"]).precision
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def without_hydra_node(config: DictConfig) -> DictConfig:
    """The job's config as its task function receives it (Hydra removes the hydra node the same way)."""
    job = copy.deepcopy(config)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job


GROUPS_OF_A_RUN = ("precision", "scaler", "recipe", "optimizer", "distributed")


def defaults_of_a_job(app_config: str, job: DictConfig) -> str:
    """The head `ampctl <command> --cfg job` prints before the config (job: composed with its hydra node): the
    defaults list that makes the dump an ampctl config again (its app config and the group options it was composed
    from), so that `-cd DIR -cn NAME` runs it with ampctl's checks, run directory and logging; and where the user's
    own configs and recipe module are (conf/config_dirs.py), so that it runs from any directory."""
    from ampctl.conf.config_dirs import searchpath_of

    choices = job.hydra.runtime.choices
    lines = [f"# ampctl's composed {app_config} config; loadable as it is: ampctl {app_config} -cd DIR -cn NAME",
             "defaults:", f"  - {app_config}",
             *(f"  - override {group}: {choices[group]}" for group in GROUPS_OF_A_RUN if choices.get(group)),
             "  - _self_", ""]
    searchpath = searchpath_of(job)
    if searchpath:  # Hydra's own key: the primary config may extend the search path
        lines += ["# composed from these directories too (your configs, your recipe's module): Hydra's search path",
                  "hydra:", "  searchpath:", *(f"  - {entry}" for entry in searchpath), ""]
    return "\n".join(lines) + "\n"


def loadable_config(app_config: str, job: DictConfig) -> str:
    """A config ampctl writes for the user to run (repaired.yaml, advised.yaml): its head, then its values."""
    return defaults_of_a_job(app_config, job) + OmegaConf.to_yaml(without_hydra_node(job))
