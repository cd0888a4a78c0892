"""`ampctl compare [overrides]`: the same run under several precision modes, one table and report (a Hydra app over
conf/compare.yaml: train's config plus compare.*)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import CompareAppConfig
from ampctl.shell.checks import one_device_only, options_of_their_groups, validate_with_loggers
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "the same run under several precision modes, one table and report"


def check(cfg: DictConfig) -> None:
    # each mode is composed and checked against the device when the comparison is planned
    validate_with_loggers(cfg)
    one_device_only(cfg, "compare")
    options_of_their_groups("compare.precisions", cfg.compare.precisions, "precision")
    options_of_their_groups("compare.optimizers", cfg.compare.optimizers, "optimizer")


def run(study: Study) -> Optional[int]:
    from ampctl.studies.compare import run_compare  # torch: imported by a comparison, not by --help

    return run_compare(study.cfg, study.out_dir, study.overrides, study.config_dir)


COMMAND = Command(
    name="compare", summary=SUMMARY, section=Section.STUDY, schema=CompareAppConfig, check=check,
    main=study_app("compare", run, stopped_with="the modes run so far are compared in {out_dir} (each interrupted "
                                                "mode's line above says whether and how it continues)"),
    api=study_api("compare", run, run_files.COMPARISON, SUMMARY),
    record=run_files.COMPARISON, rerender=lazily("ampctl.studies.compare:rerender"))
