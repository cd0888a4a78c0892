"""`ampctl memory [overrides]`: estimated memory per part next to the measured peak, per precision mode (a Hydra app
over conf/memory.yaml: train's config plus memory.*)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import MemoryAppConfig, validate
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "estimated memory per part next to the measured peak, per precision mode"


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
                  record=run_files.MEMORY, rerender=lazily("ampctl.studies.memory:rerender"))
