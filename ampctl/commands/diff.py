"""`ampctl diff [overrides]`: where the run's precision mode loses accuracy against a reference, layer by layer (a
Hydra app over conf/diff.yaml: train's config plus diff.*)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import DiffAppConfig, validate
from ampctl.errors import UsageError
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "where a precision mode loses accuracy against fp32, layer by layer, and whether it matters"


def check(cfg: DictConfig) -> None:
    validate(cfg)
    one_device_only(cfg, "diff")
    options_of_their_groups("diff.against", [cfg.diff.against], "precision")
    if cfg.precision.name == cfg.diff.against:
        raise UsageError(f"precision={cfg.precision.name} is the reference (diff.against={cfg.diff.against}): "
                         "choose the precision mode to measure against it, e.g. precision=bf16")


def run(study: Study) -> Optional[int]:
    import functools

    from ampctl.studies.diffing.diff import run_diff  # torch: imported by a diff, not by --help
    from ampctl.studies.diffing.diff_proof import prove

    prover = functools.partial(prove, config_dir=study.config_dir) if study.cfg.diff.prove else None
    run_diff(study.cfg, study.out_dir, study.overrides, prover)
    return None


COMMAND = Command(name="diff", summary=SUMMARY, section=Section.STUDY, schema=DiffAppConfig, check=check,
                  main=study_app("diff", run, stopped_with="the diff's figures are in {out_dir}, its proof's runs so "
                                                          "far in {out_dir}/proof (each continues with its line "
                                                          "above)"),
                  api=study_api("diff", run, run_files.DIFF, SUMMARY),
                  record=run_files.DIFF, rerender=lazily("ampctl.studies.diffing.diff:rerender"))
