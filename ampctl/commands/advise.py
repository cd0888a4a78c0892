"""`ampctl advise [overrides]`: the precision mode for this model on this machine, with the evidence (a Hydra app over
conf/advise.yaml: train's config plus advise.*, and the settings of the compare and inspect studies it runs)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import AdviseAppConfig, validate
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "the precision mode for this model on this machine, with the evidence"


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
    record=run_files.ADVICE, rerender=lazily("ampctl.studies.advising.advice_report:rerender"))
