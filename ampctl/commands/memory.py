"""`ampctl memory [overrides]`: estimated memory per part next to the measured peak, per precision mode (a Hydra app
over conf/memory.yaml: train's config plus memory.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import AmpctlConfig, validate
from ampctl.conf.value_checks import require
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "estimated memory per part next to the measured peak, per precision mode"


@dataclass
class MemoryConfig:
    precisions: Optional[list[str]] = None  # null: the run's own precision= only
    activation_checkpointing: Optional[list[bool]] = None  # e.g. [false,true]; null: train.activation_checkpointing
    budget: Optional[str] = None  # e.g. 80GB or 16GiB: the largest batch that fits, per mode
    steps: int = 2  # measured steps; the first allocates the optimizer's states
    timed_steps: int = 3  # more steps after the measured ones, timed (activation checkpointing's cost)
    search: Optional[bool] = None  # verify the batch estimate with real steps; null: on CUDA

    def __post_init__(self) -> None:
        require(self.precisions is None or (len(self.precisions) >= 1 and len(set(self.precisions)) == len(
            self.precisions)), "memory.precisions", self.precisions, "one or more distinct precision modes")
        require(self.activation_checkpointing is None or (len(self.activation_checkpointing) >= 1 and len(set(
            self.activation_checkpointing)) == len(self.activation_checkpointing)), "memory.activation_checkpointing",
            self.activation_checkpointing, "[false], [true] or [false,true]")
        require(self.steps >= 1, "memory.steps", self.steps, "an integer >= 1")
        require(self.timed_steps >= 0, "memory.timed_steps", self.timed_steps, "an integer >= 0")


@dataclass
class MemoryAppConfig(AmpctlConfig):
    """The primary config of `ampctl memory`: a train config plus what to measure."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)


def check(cfg: DictConfig) -> None:
    from ampctl.analysis.memory.model import parse_size

    validate(cfg)
    one_device_only(cfg, "memory")
    options_of_their_groups("memory.precisions", cfg.memory.precisions, "precision")
    if cfg.memory.budget is not None:
        parse_size(cfg.memory.budget)


def run(study: Study) -> Optional[int]:
    from ampctl.studies.memory import run_memory  # torch: imported by a measurement, not by --help

    run_memory(study.cfg, study.out_dir, study.overrides, study.config_dir)
    return None


COMMAND = Command(name="memory", summary=SUMMARY, section=Section.STUDY, schema=MemoryAppConfig, check=check,
                  main=study_app("memory", run), api=study_api("memory", run, run_files.MEMORY, SUMMARY),
                  record=run_files.MEMORY, rerender=lazily("ampctl.studies.memory_report:rerender"))
