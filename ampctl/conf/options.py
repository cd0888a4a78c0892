"""The options of a class a config names (a tracker under logger.<name>, a converter under precision.options):
an open node in the schema, typed by that class's options dataclass when the run is planned."""

from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ampctl.conf.messages import one_line
from ampctl.errors import UsageError


def typed_options(path: str, values: Mapping[str, Any], options_type: type) -> DictConfig:
    """An open node's keys (a tracker's logger.<name>, a converter's precision.options) typed by the options
    dataclass of the class that node names: a key it lacks, a wrong type, a value outside an Enum refused in one
    line that names the key by its full path (`logger.csv.fil: no such key (did you mean logger.csv.file?)`)."""
    wrapped_schema: Any = OmegaConf.structured(options_type)
    wrapped_values: Any = dict(values)
    for part in reversed(path.split(".")):
        wrapped_schema, wrapped_values = {part: wrapped_schema}, {part: wrapped_values}
    try:
        return OmegaConf.select(OmegaConf.merge(wrapped_schema, wrapped_values), path)
    except OmegaConfBaseException as exc:
        raise UsageError(one_line(exc)) from None
