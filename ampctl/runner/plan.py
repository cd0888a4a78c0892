"""A training run planned once, before anything is written: what `run_training` is handed and checks no more.

The plan is made where the run's config is known as it will run: by the command's check before Hydra creates the
run directory (commands/checks.py), by a sweep's job as it starts, by the Python API, and by the studies that
train (advise's calibration)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ampctl.analysis import mode_advice
from ampctl.conf.precision_schema import scaler_is_active
from ampctl.conf.schema import validate
from ampctl.engine import devices
from ampctl.engine import parallel as parallelism
from ampctl.engine.optim import check_optimizer_arguments, check_optimizer_with_scaler
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.runner import resume as resuming
from ampctl.runner.resume import Resume
from ampctl.runner.trackers import check_loggers


@dataclass
class RunPlan:
    """One training run as it will run: its config (a resumed run's own, with the safe changes the command line
    names), its config group choices, its precision policy (checked against the device), and where it starts
    (resume: the checkpoint, checked and loaded, and the run directory it records into). Its trackers are
    checked (installed, their own refusals)."""

    cfg: DictConfig
    choices: dict[str, str]
    policy: PrecisionPolicy
    resume: Resume
    trackers: dict[str, Any] = field(default_factory=dict)  # logger's, checked: {name: (class, typed options)}

    @property
    def run_dir(self) -> Path:
        """The directory the run records into: the checkpoint's own when it resumes another run's."""
        return self.resume.run_dir


def plan_run(cfg: DictConfig, run_dir: Path, choices: Optional[dict[str, str]] = None,
             overrides: Optional[Sequence[str]] = None, world_size: int = 1) -> RunPlan:
    """The run cfg describes, into run_dir, planned: where cfg.resume continues, its policy, its trackers.
    UsageError for what the run would refuse. With the command line's overrides, a resumed run takes its own
    config, with the keys they name taken from cfg (runner/resume.py's plan); without (a config made in Python),
    cfg is the run's config as it is."""
    if overrides is None:
        resume = Resume.find(cfg, run_dir, world_size)
    else:
        cfg, choices, resume = resuming.plan(cfg, dict(choices or {}), list(overrides), run_dir, world_size)
    policy = check_config(cfg)
    return RunPlan(cfg, dict(choices or {}), policy, resume, check_loggers(cfg.logger))


def check_config(cfg: DictConfig) -> PrecisionPolicy:
    """Everything that can be refused before building anything: ranges, then what the device can do. The policy
    it returns is what engine/build.py's build_state builds with."""
    validate(cfg)
    parallelism.check(cfg)
    device = parallelism.local_device(devices.resolve_device(cfg.device.value), cfg.distributed.kind)
    policy = PrecisionPolicy(OmegaConf.to_object(cfg.precision), device)
    mode_advice.check(policy)
    check_optimizer_with_scaler(cfg.optimizer, scaler_is_active(cfg.scaler))
    check_optimizer_arguments(cfg.optimizer)
    return policy
