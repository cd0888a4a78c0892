"""A command's run, planned before anything is written: its config typed by its schema and checked, its directory
claimed, and (train) its resume resolved. Made once, by the check Hydra's callback runs on a single run (or by the
Python API), and handed to the task function through THIS_PROCESS (shell/this_process.py); a sweep's job is planned
as it starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ampctl.conf.composing import without_hydra_node
from ampctl.conf.config_dirs import make_importable, user_config_dirs
from ampctl.conf.messages import one_line
from ampctl.conf.typed import typed_config
from ampctl.errors import ConfigError, UsageError
from ampctl.processes import is_main_process
from ampctl.shell.command import command_named
from ampctl.shell.plan_kinds import Plan, StudyPlan
from ampctl.shell.this_process import THIS_PROCESS

if TYPE_CHECKING:
    pass


def typed(command: str, cfg: DictConfig) -> DictConfig:
    """cfg typed by `command`'s schema (a key it lacks, a value of the wrong type: UsageError)."""
    try:
        return typed_config(cfg, command_named(command).schema)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None


def check_command(command: str, cfg: DictConfig) -> DictConfig:
    """cfg typed by `command`'s schema and checked; raises UsageError. Returns the typed config."""
    cfg = typed(command, cfg)
    check = command_named(command).check
    if check is not None:
        check(cfg)
    return cfg


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides as typed: `train.steps=${x}` is text here, not an interpolation to resolve."""
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]  # type: ignore[union-attr]


def refuse_numbers_for_booleans(cfg: DictConfig, overrides: list[str]) -> None:
    """`telemetry.profile_cpu_memory=2`: OmegaConf takes any integer for a boolean (2 is true); a number where
    true or false is expected is a mistake, refused naming the key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import BooleanNode

    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete() or override.is_sweep_override() or "/" in override.key_or_group:
            continue
        value = override.value()
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        node: Any = cfg
        for part in override.key_or_group.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if isinstance(node, BooleanNode):
            raise ConfigError(override.key_or_group, value, "true or false")


def main_run_dir(hydra_cfg: DictConfig) -> Path:
    """Rank 0's run directory, on any rank. The other ranks run with hydra.run.dir=. (they write nothing of
    their own); they read the run dir the command line gave, which names the same directory on every rank
    when resume=auto has one to continue (a timestamped default is a new directory on every rank). A job
    that runs has its own directory (a sweep's job: under the sweep's); a run being checked, the one planned."""
    if is_main_process():
        job_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None, throw_on_missing=False)
        return Path(job_dir or hydra_cfg.run.dir)
    given = [o.split("=", 1)[1] for o in hydra_cfg.overrides.hydra if o.startswith("hydra.run.dir=")]
    return Path(given[-2] if len(given) > 1 else ".")


def plan_of_a_job(command: str, cfg: DictConfig, hydra_cfg: DictConfig) -> Plan:
    """A job's plan from its typed config and Hydra's node: the command's own planner (train: its resume), or the
    checked config and its choices."""
    planner = command_named(command).plan
    if planner is not None:
        return planner(cfg, hydra_cfg)
    check = command_named(command).check
    if check is not None:
        check(cfg)
    return StudyPlan(cfg, dict(hydra_cfg.runtime.choices))


def plan_a_single_run(command: str, config: DictConfig) -> Plan:
    """A single run's plan (its config with the hydra node, as Hydra or the Python API composed it), before anything
    is written: its values, and that its output directory is its own (the command's claim). UsageError when
    refused."""
    from ampctl.runner.ownership import refuse_another_commands_directory

    make_importable(user_config_dirs(config.hydra))  # a written config's hydra.searchpath: its user's recipe
    cfg = typed(command, without_hydra_node(config))
    refuse_numbers_for_booleans(cfg, task_overrides(config.hydra))
    claim = command_named(command).claim_directory
    if claim is not None:
        claim(cfg, str(config.hydra.run.dir))  # as given: Path would read '' as . and s3://b as s3:/b
    else:
        refuse_another_commands_directory(command, config.hydra.run.dir)
    return plan_of_a_job(command, cfg, config.hydra)


def plan_of(command: str, cfg: DictConfig, hydra_cfg: DictConfig) -> Plan:
    """In a command's task function: the plan its check made for this run, or, for a sweep's job (checked with the
    others before the first started), the plan as this job runs it."""
    planned = THIS_PROCESS.take_plan(Path(hydra_cfg.runtime.output_dir))
    if planned is not None:
        return planned
    make_importable(user_config_dirs(hydra_cfg))  # a sweep's job, in a process of its own (submitit, Ray)
    return plan_of_a_job(command, typed(command, cfg), hydra_cfg)
