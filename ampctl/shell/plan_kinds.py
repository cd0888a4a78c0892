"""What a planned command is (shell/plans.py makes them): a training run's plan (runner/plan.py's RunPlan) or a
study's. Apart from the planning, so that what holds a plan (shell/this_process.py) names its type without importing
the planning, which hands its plan over through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from omegaconf import DictConfig

if TYPE_CHECKING:
    from ampctl.runner.plan import RunPlan


@dataclass
class StudyPlan:
    """A study command's run as it will run, once checked: its config and its group choices."""

    cfg: DictConfig
    choices: dict[str, str]


# A command's plan: a training run's or a study's; each holds its checked config as .cfg
Plan = Union["RunPlan", StudyPlan]
