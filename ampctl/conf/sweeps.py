"""The jobs of a Hydra multirun, from its config, through Hydra's public override parser.

Sweeps are expanded only for Hydra's basic sweeper (a list or range per key); another sweeper (Optuna, Ax,
Nevergrad) chooses its jobs as it goes.
"""

from __future__ import annotations

import itertools
from typing import Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # the default's _target_, a name only


def sweep_overrides(config: DictConfig) -> list[str]:
    """The overrides the sweeper expands: `hydra.sweeper.params` from the config, then the command line's."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()] + [str(o) for o in config.hydra.overrides.task]


def expand(overrides: list[str]) -> Optional[list[list[str]]]:
    """Every job's overrides, as Hydra's basic sweeper forms them (the product of each key's values, a later
    value of a key replacing an earlier one); None when a sweep is not a list (interval(), a tag)."""
    values: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            return None
    return [list(job) for job in itertools.product(*values.values())]


def base_overrides(overrides: list[str]) -> list[str]:
    """The overrides every job shares: the command line without its sweeps."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [text for text, override in zip(overrides, parsed) if not override.is_sweep_override()]


def planned_jobs(config: DictConfig) -> Optional[list[list[str]]]:
    """The jobs of this multirun, when the sweeper is Hydra's basic one; None when a plugin chooses them."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    return expand(sweep_overrides(config))
