"""`ampctl compare [overrides]`: the same run under several precision modes, one table and report (a Hydra app over
conf/compare.yaml: train's config plus compare.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.schema import AmpctlConfig
from ampctl.conf.value_checks import require
from ampctl.shell.checks import one_device_only, options_of_their_groups, validate_with_loggers
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "the same run under several precision modes, one table and report"


@dataclass
class CompareConfig:
    # null: every mode this device runs at speed among DEFAULT_COMPARE_PRECISIONS
    precisions: Optional[list[str]] = None
    warmup_steps: int = 10  # steps left out of each mode's timings
    # the modes take turns in this many rounds after the warm-up (each a window of steps of every mode, one mode at
    # a time): each mode's step time is the median of its rounds, its speedup the median of its rounds' ratios to
    # the baseline's, with an interval; null: short turns (TURN_STEPS steps), as many as the steps allow, so that the
    # two sides of a ratio run seconds apart and load falls on both alike; 1: one after another
    rounds: Optional[int] = None
    # each mode trains with this many seeds (train.seed, +1, ...): accuracy parity with fp32 is judged against the
    # seed-to-seed noise (reports/parity.py); the seeds' rounds all count in the timings
    seeds: int = 1
    # [false,true]: each mode without and with activation checkpointing (rows "bf16", "bf16+ac")
    activation_checkpointing: Optional[list[bool]] = None
    # [false,true]: each mode eager and compiled (rows "bf16", "bf16+compile"); null: [train.compile.enabled], one
    # setting for every mode, so that no mode is credited with compile's gain
    compile: Optional[list[bool]] = None
    # [adamw,adamw_8bit]: each mode with each optimizer (rows "bf16_true+adamw", "bf16_true+adamw_8bit"), a
    # combination that cannot run skipped with its reason; null: the run's optimizer, one for every mode
    optimizers: Optional[list[str]] = None

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "compare.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.rounds is None or self.rounds >= 1, "compare.rounds", self.rounds,
                "an integer >= 1, or null for short turns")
        require(self.seeds >= 1, "compare.seeds", self.seeds, "an integer >= 1")
        for key in ("precisions", "optimizers"):
            names = getattr(self, key)
            require(names is None or (len(names) >= 1 and len(set(names)) == len(names)), f"compare.{key}",
                    names, f"one or more distinct {'precision modes' if key == 'precisions' else 'optimizers'}")
        for key in ("activation_checkpointing", "compile"):
            settings = getattr(self, key)
            require(settings is None or (len(settings) >= 1 and len(set(settings)) == len(settings)),
                    f"compare.{key}", settings, "[false], [true] or [false,true]")


@dataclass
class CompareAppConfig(AmpctlConfig):
    """The primary config of `ampctl compare`: a train config plus what to compare."""

    compare: CompareConfig = field(default_factory=CompareConfig)


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
