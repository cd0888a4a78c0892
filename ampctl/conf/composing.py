"""A job's config composed inside a running Hydra app (compare's modes, memory's rows, a sweep's jobs checked
before the first starts): Hydra's compose with the app's own search path (`-cd` included), a failure the
command line's one line."""

from __future__ import annotations

from hydra import compose
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from ampctl.conf.messages import one_line
from ampctl.errors import UsageError


def compose_job(config_name: str, overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None
