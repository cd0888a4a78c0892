"""The schemas of the study commands' own settings (compare.*, memory.*, inspect.*, advise.*): types, defaults and
range checks (see conf/schema.py, which stores each command's primary config)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from ampctl.conf.fields import OptionsOf, one_of
from ampctl.conf.value_checks import require


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


# The modes `ampctl compare` runs when compare.precisions is null (those the device can run).
DEFAULT_COMPARE_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "O2")


@dataclass
class MemoryConfig:
    precisions: Optional[list[str]] = None  # null: the run's own precision= only
    activation_checkpointing: Optional[list[bool]] = None  # e.g. [false,true]; null: train.activation_checkpointing
    budget: Optional[str] = None  # e.g. 80GB or 16GiB: the largest batch that fits, per mode
    steps: int = 2  # measured steps; the first allocates the optimizer's states
    timed_steps: int = 3  # more steps after the measured ones, timed (activation checkpointing's cost)
    search: Optional[bool] = None  # verify the batch estimate with real steps; null: on CUDA

    def __post_init__(self) -> None:
        require(self.precisions is None or (len(self.precisions) >= 1 and len(set(self.precisions)) == len(
            self.precisions)), "memory.precisions", self.precisions, "one or more distinct precision modes")
        require(self.activation_checkpointing is None or (len(self.activation_checkpointing) >= 1 and len(set(
            self.activation_checkpointing)) == len(self.activation_checkpointing)), "memory.activation_checkpointing",
            self.activation_checkpointing, "[false], [true] or [false,true]")
        require(self.steps >= 1, "memory.steps", self.steps, "an integer >= 1")
        require(self.timed_steps >= 0, "memory.timed_steps", self.timed_steps, "an integer >= 0")


@dataclass
class InspectConfig:
    steps: int = 3  # training steps recorded
    loss_scale: Optional[float] = None  # the loss scale studied; null: the mode's scaler's, else 65536

    def __post_init__(self) -> None:
        require(self.steps >= 1, "inspect.steps", self.steps, "an integer >= 1")


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


def budget_seconds(text: str) -> Optional[float]:
    """'1h30m' -> 5400.0; None when it is no duration (a positive one of h, min or m, s)."""
    number = r"(\d+(?:\.\d+)?)"
    match = re.fullmatch(rf"\s*(?:{number}\s*h)?\s*(?:{number}\s*(?:min|m))?\s*(?:{number}\s*s)?\s*", str(text))
    if match is None or not any(match.groups()):
        return None
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    return total if total > 0 else None
