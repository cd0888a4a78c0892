"""A config typed by its schema: what Hydra composed, or a YAML loaded back from `--cfg job`, merged onto
the schema dataclasses so that every node is typed and a key the schema lacks is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ampctl.conf.messages import did_you_mean
from ampctl.conf.precision_schema import SCALER_SCHEMAS
from ampctl.conf.schema import AmpctlConfig
from ampctl.errors import ConfigError, UsageError

# The nodes that held a built-in converter's options before precision.options did (a run recorded then resumes).
FORMER_OPTION_NODES = ("fp8_emulated", "fp8_torchao", "mx")


def as_recorded_now(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded config (a checkpoint's, identity.json's) in today's schema: a converter's options recorded
    under the node of its own that a built-in converter had then are its precision.options."""
    precision = saved.get("precision")
    if not isinstance(precision, dict) or not any(key in precision for key in FORMER_OPTION_NODES):
        return saved
    precision = dict(precision)
    for key in FORMER_OPTION_NODES:
        value = precision.pop(key, None)
        if value is not None:
            precision["options"] = value
    return {**saved, "precision": precision}


def typed_config(cfg: DictConfig, schema: type = AmpctlConfig) -> DictConfig:
    """cfg merged onto its schema: every node typed, a key the schema lacks refused. A config Hydra composed
    from ampctl's YAMLs is typed already, except keys added with `+` (`+train.stepz=5`); a config loaded back
    from `--cfg job` (no defaults list) is plain YAML until it passes through here."""
    scaler = cfg.get("scaler")
    kind = scaler.get("kind") if isinstance(scaler, DictConfig) else None
    if kind not in SCALER_SCHEMAS:
        raise ConfigError("scaler.kind", kind, " | ".join(SCALER_SCHEMAS))
    typed = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    typed.scaler = OmegaConf.merge(OmegaConf.structured(SCALER_SCHEMAS[kind]), scaler)
    _refuse_unknown_keys(typed, "")
    return typed


def _refuse_unknown_keys(node: DictConfig, path: str) -> None:
    """A key a typed node's dataclass lacks (OmegaConf keeps one added with force_add, as Hydra's `+` does)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        if key not in names:
            allowed = [n for n in names if n != "kind"]
            raise UsageError(f"{path}{key}: no such key{did_you_mean(str(key), allowed, path)}; allowed: "
                             f"{', '.join(allowed)}{_group_hint(path, key, node[key])}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            _refuse_unknown_keys(child, f"{path}{key}.")


def _group_hint(path: str, key: str, value: object) -> str:
    """`+experiment=x` without a group of that name is taken for a new key: say how to make it a config group."""
    if path or not isinstance(value, str) or not value.replace("_", "").replace("-", "").isalnum():
        return ""
    return (f". To choose {key}={value} from a config group of your own, put it in DIR/{key}/{value}.yaml (first "
            f"line `# @package _global_` to set keys anywhere) and run with -cd DIR +{key}={value} (docs/sweeps.md)")
