"""`ampctl inspect [overrides]`: where values fall against fp16, bf16 and FP8 ranges, per layer (a Hydra app over
conf/inspect.yaml: train's config plus inspect.*). The module is not named `inspect`, the standard library's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import AmpctlConfig, validate
from ampctl.conf.value_checks import require
from ampctl.shell.checks import one_device_only
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "where values fall against fp16, bf16 and FP8 ranges, per layer"


@dataclass
class InspectConfig:
    steps: int = 3  # training steps recorded
    loss_scale: Optional[float] = None  # the loss scale studied; null: the mode's scaler's, else 65536

    def __post_init__(self) -> None:
        require(self.steps >= 1, "inspect.steps", self.steps, "an integer >= 1")


@dataclass
class InspectAppConfig(AmpctlConfig):
    """The primary config of `ampctl inspect`: a train config plus what to inspect."""

    inspect: InspectConfig = field(default_factory=InspectConfig)


def check(cfg: DictConfig) -> None:
    from ampctl.analysis.ranges import power_of_two_log2

    validate(cfg)
    one_device_only(cfg, "inspect")
    if cfg.inspect.loss_scale is not None:
        power_of_two_log2(cfg.inspect.loss_scale, "inspect.loss_scale")


def run(study: Study) -> Optional[int]:
    from ampctl.studies.inspect_ranges import run_inspect  # torch: imported by an inspection, not by --help

    run_inspect(study.cfg, study.out_dir, study.overrides)
    return None


COMMAND = Command(name="inspect", summary=SUMMARY, section=Section.STUDY, schema=InspectAppConfig, check=check,
                  main=study_app("inspect", run), api=study_api("inspect", run, run_files.INSPECTION, SUMMARY),
                  record=run_files.INSPECTION, rerender=lazily("ampctl.studies.inspect_ranges:rerender"))
