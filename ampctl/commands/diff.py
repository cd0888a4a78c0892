"""`ampctl diff [overrides]`: where the run's precision mode loses accuracy against a reference, layer by layer (a
Hydra app over conf/diff.yaml: train's config plus diff.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.commands.compare import CompareConfig
from ampctl.conf.fields import OptionsOf, one_of
from ampctl.conf.schema import AmpctlConfig, validate
from ampctl.conf.value_checks import budget_seconds, require
from ampctl.errors import UsageError
from ampctl.shell.checks import one_device_only, options_of_their_groups
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "where a precision mode loses accuracy against fp32, layer by layer, and whether it matters"


@dataclass
class DiffConfig:
    """diff.*: the reference the run's precision mode is measured against, layer by layer (studies/diffing/diff.py)."""

    against: str = one_of("fp32", OptionsOf("precision"))  # the reference precision mode
    # the weights both start from: null, a fresh init at train.seed; a run directory (its newest checkpoint that
    # passes its check) or a checkpoint: where training has taken them (divergence often starts late)
    weights: Optional[str] = None
    batches: int = 8  # batches through both, the same weights (the gradient's noise is measured across them)
    # the candidate's gradient error counts as below the gradient's batch-to-batch noise under this share of it
    noise_share: float = 0.1
    top: int = 10  # the layers ranked on the screen (every layer in diff.csv)
    # the fewest layers, raised one step (a format -> unconverted, half -> fp32), that bring the gradient's error
    # under the yardstick; repaired.yaml runs them (studies/diffing/diff_repair.py). At most repair_layers of them
    repair: bool = False
    repair_layers: int = 8
    # the reference, the candidate and the repaired candidate trained side by side over compare.seeds seeds (compare's
    # rounds and held-out parity, studies/diffing/diff_proof.py), within what is left of diff.budget
    prove: bool = False
    budget: str = "10min"  # the whole diff's: 90s, 10min, 1h30m

    def __post_init__(self) -> None:
        require(self.batches >= 2, "diff.batches", self.batches,
                "an integer >= 2 (the yardstick is the gradient's spread from batch to batch)")
        require(0.0 < self.noise_share <= 1.0, "diff.noise_share", self.noise_share, "a share in (0, 1]")
        require(self.top >= 1, "diff.top", self.top, "an integer >= 1")
        require(self.repair_layers >= 1, "diff.repair_layers", self.repair_layers, "an integer >= 1")
        require(budget_seconds(self.budget) is not None, "diff.budget", self.budget,
                "a duration such as 90s, 10min, 1h or 1h30m")


@dataclass
class DiffAppConfig(AmpctlConfig):
    """The primary config of `ampctl diff`: a train config (the candidate: its precision mode) plus what to measure
    it against."""

    diff: DiffConfig = field(default_factory=DiffConfig)
    compare: CompareConfig = field(default_factory=lambda: CompareConfig(seeds=3, warmup_steps=5))  # diff.prove's


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
