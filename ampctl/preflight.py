"""Check a command line before Hydra runs anything.

Hydra reports a bad override (unknown option, wrong type, unknown key) with exit code 1 and several lines,
and in a multirun only when it reaches the bad job. ampctl instead composes every job's config up front
with Hydra's compose API, validates it, and checks it against the device, so a mistake anywhere in a sweep
is one line and exit code 2 before the first job starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Optional

from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from ampctl.errors import UsageError

CONFIG_MODULE = "ampctl.conf"


def job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every job Hydra would launch (one job without --multirun)."""
    if not multirun:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def preflight(argv: list[str], config_name: str, check: Callable[[DictConfig], object]) -> int:
    """Compose and check every job of this command line. Returns the number of jobs; raises UsageError."""
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.shell_completion or args.config_path:
        return 0  # nothing will be trained; Hydra handles these itself
    overrides = list(args.overrides)
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    name = args.config_name or config_name
    try:
        jobs = job_overrides(overrides, args.multirun)
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            for job in jobs:
                try:
                    cfg = compose(config_name=name, overrides=job)
                except AssertionError:
                    # OmegaConf asserts when an override sets a key under a node that is null in this
                    # config (precision.fp8.margin=2 under precision=fp32, whose fp8 node is null)
                    raise UsageError(_key_under_null_node(name, job)) from None
                if args.cfg is None and args.info is None:
                    check(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None
    return len(jobs)


def _key_under_null_node(config_name: str, job: list[str]) -> str:
    """The override that set a key under a null node, and which options of its group have that node."""
    key_of = lambda override: override.split("=", 1)[0].lstrip("+~")  # noqa: E731
    choices = [o for o in job if "=" in o and "." not in key_of(o)]  # group choices: precision=fp32
    base = compose(config_name=config_name, overrides=choices)
    for override in job:
        parts = key_of(override).split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if OmegaConf.select(base, parent) is not None or depth == 1:
                continue
            group = parts[0]
            owners = [option for option in GlobalHydra.instance().config_loader().get_group_options(group)
                      if OmegaConf.select(compose(config_name=config_name, overrides=[*choices, f"{group}={option}"]),
                                          parent) is not None]
            chosen = OmegaConf.select(base, f"{group}.name", default=None)
            where = f"{group}={chosen}" if chosen else "this config"
            return (f"{override}: {where} has no {parent}" + (f"; it belongs to {group}={' | '.join(owners)}"
                                                               if owners else ""))
    return f"{' '.join(job)}: an override sets a key under a node that is null in this config"


def one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line reports, reduced to the line a user needs."""
    for err in _chain(exc):
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
                return f"{err.full_key}: no such key{_allowed_keys(err)}"
            msg = str(getattr(err, "msg", "") or err).splitlines()[0]
            return _type_error(err.full_key, msg) or f"{err.full_key}: {msg}"
    text = str(exc).strip()
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
        allowed = f"; choose one of {', '.join(options)}" if options else ""
        return f"{group}={option}: no such {group}{allowed}"
    text = text.replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception.", "")
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def _type_error(key: str, msg: str) -> Optional[str]:
    """OmegaConf's conversion messages as `key=value is not allowed: expected ...`."""
    conversion = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", msg)
    if conversion:
        value, type_name = conversion.groups()
        return f"{key}={value!r} is not allowed: expected {_TYPE_NAMES.get(type_name, type_name)}"
    boolean = re.match(r"Value '(.*)' is not a valid bool", msg)
    if boolean:
        return f"{key}={boolean.group(1)!r} is not allowed: expected true or false"
    choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", msg)
    if choice:
        return f"{key}={choice.group(1)!r} is not allowed: expected one of {choice.group(2)}"
    return None


def _allowed_keys(err: OmegaConfBaseException) -> str:
    """The keys the node does have, from its schema dataclass (e.g. which keys scaler=none takes)."""
    schema = getattr(err, "object_type", None)
    if not dataclasses.is_dataclass(schema):
        return ""
    fields = {f.name: f.default for f in dataclasses.fields(schema)}
    kind = fields.pop("kind", None)
    if not fields:
        return f": scaler={kind} takes no keys (choose scaler=dynamic or scaler=static before setting scaler.*)"
    return f"; allowed: {', '.join(fields)}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
