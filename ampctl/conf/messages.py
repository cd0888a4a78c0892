"""Hydra's and OmegaConf's multi-line reports, reduced to the one line a user needs (exit code 2)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from importlib import resources
from typing import Optional

import yaml
from hydra.errors import MissingConfigException
from omegaconf import BooleanNode, DictConfig, EnumNode, FloatNode, IntegerNode, StringNode
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from ampctl.conf.migration import new_home

# The nodes that held a built-in converter's options before each mode's converter took its options at
# precision.options, and the modes they belong to.
RENAMED_KEYS = {"precision.fp8": "fp8_emulated", "precision.fp8_emulated": "fp8_emulated", "precision.float8": "fp8",
                "precision.fp8_torchao": "fp8", "precision.mx": "mxfp8, mxfp4 or nvfp4"}
# Keys that became something else, and what to write instead.
REPLACED_KEYS = {"precision.keep_norm_fp32": "replaced by the per-layer rule {type: norm, run_in: fp32}, O2's default "
                 "(precision.rules=[] runs the norms in half; docs/precision.md)"}


def one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line reports, reduced to the line a user needs."""
    for err in _chain(exc):
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            # a key of the layout before train.* was grouped by concern: no such key, or (train.compile=true) a
            # value where its group is now
            if new_home(err.full_key) and isinstance(err, (ConfigKeyError, ConfigAttributeError, ValidationError)):
                return (f"{err.full_key}: moved to {new_home(err.full_key)} (train.* is grouped by concern: "
                        "lr, checkpoint, eval, ema, cluster, compile)")
            if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
                if err.full_key in REPLACED_KEYS:
                    return f"{err.full_key}: {REPLACED_KEYS[err.full_key]}"
                if err.full_key in RENAMED_KEYS:
                    return (f"{err.full_key}: renamed; set precision.options.* (the options of "
                            f"precision={RENAMED_KEYS[err.full_key]})")
                full_key = _in_list(err) + err.full_key
                parent, _, key = full_key.rpartition(".")
                close = did_you_mean(key, _keys(err), prefix=f"{parent}." if parent else "")
                return f"{full_key}: no such key{close}{_allowed_keys(err) or _open_node_keys(err)}"
            msg = str(getattr(err, "msg", "") or err).splitlines()[0]
            if isinstance(err, MissingMandatoryValue):
                return f"{err.full_key}: required, and not given"
            if "Cannot merge DictConfig with ListConfig" in msg or "Cannot merge ListConfig with DictConfig" in msg:
                return f"{err.full_key}: expected a list ([...]), as the schema's {err.full_key} is"
            return _type_error(err) or f"{err.full_key}: {msg}"
    primary = next((err for err in _chain(exc) if isinstance(err, MissingConfigException)
                    and err.missing_cfg_file and "/" not in err.missing_cfg_file
                    and "primary config" in str(err)), None)
    if primary is not None:  # -cn NAME: Hydra's message lists its search path, not where the user's configs go
        name = primary.missing_cfg_file
        return (f"-cn {name}: no config {name}.yaml in ampctl's configs or a -cd directory; give -cd DIR with "
                f"{name}.yaml in it (ampctl init {name} writes one)")
    missing = next((err for err in _chain(exc) if isinstance(err, MissingConfigException)
                    and err.missing_cfg_file and "/" in err.missing_cfg_file), None)
    if missing is not None:
        group, _, option = missing.missing_cfg_file.rpartition("/")
        # Hydra lists the options when one was chosen, not for a list (logger=[csv,nope]): ampctl's own then
        options = list(missing.options or []) or _shipped_options(group)
        if group in ("hydra/sweeper", "hydra/launcher"):
            return _missing_plugin(group, option, options)
        allowed = f"; choose one of {', '.join(options)}" if options else ""
        return f"{group}={option}: no such {group}{did_you_mean(option, options)}{allowed}"
    text = str(exc).strip()
    text = text.replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception.", "")
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _shipped_options(group: str) -> list[str]:
    folder = resources.files("ampctl.conf").joinpath(group)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")) if folder.is_dir() else []


def did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    """' (did you mean X?)' for the one choice that differs only in case (FP16: fp16), else the closest of choices
    (difflib's ratio >= 0.6), or nothing."""
    same = [c for c in choices if c.lower() == word.lower() and c != word]
    close = same or difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


# The schema's list elements, where OmegaConf's error names a key of one without the list's path.
LIST_ELEMENTS = {"LayerRule": "precision.rules[]."}


def _in_list(err: OmegaConfBaseException) -> str:
    schema = getattr(err, "object_type", None)
    prefix = LIST_ELEMENTS.get(getattr(schema, "__name__", ""), "")
    return "" if err.full_key.startswith(prefix.split("[")[0]) else prefix


def _keys(err: OmegaConfBaseException) -> list[str]:
    schema = getattr(err, "object_type", None)
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def instantiation_error(exc: BaseException) -> str:
    """Why Hydra's instantiate() failed: its own first line ends at a colon ("Error in call to target
    'x.Y':"), so the innermost cause is named instead, with its first line."""
    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip()
    line = text.splitlines()[0].split(", set env var HYDRA_FULL_ERROR")[0] if text else ""
    return f"{type(cause).__name__}: {line}" if cause is not exc else line or type(exc).__name__


def yaml_error(exc: Exception) -> str:
    """A YAML file Hydra could not parse (a config under -cd): the file, line and column, and the problem."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None:
        return f"malformed YAML: {' '.join(str(exc).split())}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    since = (f" ({context} from line {context_mark.line + 1}, column {context_mark.column + 1})"
             if context and context_mark is not None else "")
    return f"malformed YAML in {mark.name}, line {mark.line + 1}, column {mark.column + 1}: {problem}{since}"


# Hydra's sweeper and launcher plugins, by the option name each registers, and the package that provides it.
HYDRA_PLUGINS = {
    "optuna": "hydra-optuna-sweeper",
    "ax": "hydra-ax-sweeper",
    "nevergrad": "hydra-nevergrad-sweeper",
    "joblib": "hydra-joblib-launcher",
    "ray": "hydra-ray-launcher",
    "rq": "hydra-rq-launcher",
    "submitit_local": "hydra-submitit-launcher",
    "submitit_slurm": "hydra-submitit-launcher",
}


def _missing_plugin(group: str, option: str, installed: list[str]) -> str:
    kind = group.split("/")[1]
    package = HYDRA_PLUGINS.get(option)
    fix = (f"pip install {package}" if package
           else f"install the Hydra {kind} plugin that provides it") + f" (installed: {', '.join(installed) or 'none'})"
    return f"{group}={option}: the {kind} plugin is not installed; {fix}"


@functools.cache
def mode_options() -> dict[str, dict]:
    """Each shipped converter mode's precision.options (its converter's options, every one at the mode's default),
    by mode, as ampctl/conf/precision/*.yaml set them."""
    modes: dict[str, dict] = {}
    for option in _shipped_options("precision"):
        text = resources.files("ampctl.conf").joinpath("precision", f"{option}.yaml").read_text(encoding="utf-8")
        options = (yaml.safe_load(text) or {}).get("options")
        if isinstance(options, dict):
            modes[option] = options
    return modes


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def key_under_null_node(overrides: list[str]) -> Optional[str]:
    """OmegaConf asserts, without naming the key, when an override sets a key under a node that is null in
    the composed config: precision.options.margin=2 under precision=fp32. Which override, and the fix."""
    chosen = {value for key, _, value in (o.lstrip("+~").partition("=") for o in overrides) if key == "precision"}
    for override in overrides:
        parts = override.split("=", 1)[0].lstrip("+~").split(".")
        if len(parts) >= 3 and parts[:2] == ["precision", "options"]:
            modes = mode_options()
            owners = [mode for mode, options in modes.items() if parts[2] in options]
            if chosen & set(owners) or chosen - set(_shipped_options("precision")):
                continue  # its mode chosen (the value is what is wrong), or a mode of one's own (its YAML knows)
            if not owners:
                every = sorted({key for options in modes.values() for key in options})
                return (f"{override}: no converter mode has the option precision.options.{parts[2]}"
                        f"{did_you_mean(parts[2], every, 'precision.options.')}; the converter modes are "
                        f"precision={_either(list(modes))}")
            return (f"{override}: precision.options.{parts[2]} is an option of precision={_either(owners)} only; "
                    f"choose it on the same command line (precision={owners[0]} {override})")
        if len(parts) >= 3 and parts[0] == "logger" and parts[1] not in _chosen_loggers(overrides):
            return (f"{override}: logger.{parts[1]}.* are the options of logger={parts[1]}, which is not chosen; "
                    f"choose it on the same command line (logger={parts[1]} {override}, or logger=[...,{parts[1]}])")
    return None


def unparsable_override(args: list[str], exc: BaseException) -> Optional[str]:
    """Hydra's grammar error (`no viable alternative at input '[{match:...}'`) names the text, not the override:
    the override it could not parse, then Hydra's reason."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not isinstance(exc, HydraException):
        return None
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_override(arg)
        except HydraException:
            key, _, value = arg.partition("=")
            if value.startswith("~"):  # a shell expands ~ only in a variable's assignment, which key.path= is not
                return (f"{key}={value}: the shell leaves ~ as it is after a config key's =, and Hydra's grammar "
                        f"refuses it: write $HOME{value[1:]} (or the path in full)")
            return (f"{key}: its value cannot be parsed ({one_line(exc)}): a list or dict needs its closing bracket, "
                    "and the whole override quotes in a shell")
    return None


def _chosen_loggers(overrides: list[str]) -> set[str]:
    chosen: set[str] = set()
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "logger":
            chosen.update(v.strip() for v in value.strip("[]").split(","))
    return chosen


_EXPECTED = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string"}


def _type_error(err: OmegaConfBaseException) -> Optional[str]:
    """A value the schema's node cannot take, as `key=value is not allowed: expected ...`, from the node's type."""
    node = getattr(err, "child_node", None)
    if not isinstance(err, ValidationError) or node is None:
        return None
    if isinstance(node, EnumNode):
        expected: Optional[str] = "one of " + ", ".join(member.name for member in node.enum_type)
    else:
        expected = _EXPECTED.get(type(node))
    return f"{err.full_key}={err.value!r} is not allowed: expected {expected}" if expected else None


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


def _open_node_keys(err: OmegaConfBaseException) -> str:
    """A node without a schema (a recipe's or optimizer's arguments, a dict of library options like
    recipe.config): its keys, and Hydra's way to add one it does not have yet."""
    node = getattr(err, "parent_node", None)
    if not isinstance(node, DictConfig) or dataclasses.is_dataclass(getattr(err, "object_type", None)):
        return ""
    keys = [str(k) for k in node.keys() if not str(k).startswith("_")]
    parent, _, key = err.full_key.rpartition(".")
    close = did_you_mean(key, keys, prefix=f"{parent}." if parent else "")
    if close:
        return f"{close}; it has {', '.join(keys)}"
    have = f"; it has {', '.join(keys)}" if keys else ""
    return f"{have}; to add a key {parent or 'the config'} does not have, write +{err.full_key}=..."


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
