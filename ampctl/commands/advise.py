"""`ampctl advise [overrides]`: the precision mode for this model on this machine, with the evidence (a Hydra app over
conf/advise.yaml: train's config plus advise.*, and the settings of the compare and inspect studies it runs)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.commands.compare import CompareConfig
from ampctl.commands.inspect_command import InspectConfig
from ampctl.conf.schema import AmpctlConfig, validate
from ampctl.conf.value_checks import budget_seconds, require
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "the precision mode for this model on this machine, with the evidence"


class AdviseGoal(Enum):
    speed = "speed"  # the fastest mode whose accuracy matches fp32's
    memory = "memory"  # the mode with the smallest peak whose accuracy matches fp32's
    accuracy = "accuracy"  # fp32's numbers: the others as alternatives, with what they would cost


@dataclass
class AdviseConfig:
    budget: str = "10min"  # the time advise may take in all: 90s, 10min, 1h30m
    goal: AdviseGoal = AdviseGoal.speed
    name: str = "advised"  # the experiment config it writes: <run dir>/<name>.yaml
    # torch.compile measured (each mode eager and compiled): null, where the budget leaves each run enough steps
    # after the compile time the calibration measured; true, always; false, never
    compile: Optional[bool] = None
    # FP8 and MX modes: a layer whose format loses more than this share of an operand's values (saturated or
    # flushed to zero, as inspect counts them in that mode) stays unconverted
    layer_loss_limit: float = 0.02

    def __post_init__(self) -> None:
        require(budget_seconds(self.budget) is not None, "advise.budget", self.budget,
                "a duration such as 90s, 10min, 1h or 1h30m")
        require(0.0 <= self.layer_loss_limit < 1.0, "advise.layer_loss_limit", self.layer_loss_limit,
                "a share of values from 0 to below 1 (0.02: 2%)")
        require(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name)), "advise.name", self.name,
                "a config name: letters, digits and _")


@dataclass
class AdviseAppConfig(AmpctlConfig):
    """The primary config of `ampctl advise`: a train config, what to advise on, and the settings of the compare
    and inspect studies it runs."""

    advise: AdviseConfig = field(default_factory=AdviseConfig)
    compare: CompareConfig = field(default_factory=lambda: CompareConfig(seeds=3, warmup_steps=5))
    inspect: InspectConfig = field(default_factory=lambda: InspectConfig(steps=2))


def check(cfg: DictConfig) -> None:
    validate(cfg)  # its studies check each mode and run as they go
    one_device_only(cfg, "advise")
    options_of_their_groups("compare.precisions", cfg.compare.precisions, "precision")
    options_of_their_groups("compare.optimizers", cfg.compare.optimizers, "optimizer")


def run(study: Study) -> Optional[int]:
    from ampctl.studies.advising.advise import run_advise  # torch: imported by the advice, not by --help
    from ampctl.studies.diffing.diff import run_diff  # a mode ruled out by its accuracy is repaired with it

    run_advise(study.cfg, study.out_dir, study.overrides, study.config_dir, run_diff)
    return None


COMMAND = Command(
    name="advise", summary=SUMMARY, section=Section.STUDY, schema=AdviseAppConfig, check=check,
    main=study_app("advise", run, interrupted_means=" (nothing was compared yet: no advice)",
                   stopped_with="the advice of what was measured is in {out_dir}"),
    api=study_api("advise", run, run_files.ADVICE, SUMMARY),
    record=run_files.ADVICE, rerender=lazily("ampctl.studies.advising.advice_report:rerender"), composes=("diff",))
