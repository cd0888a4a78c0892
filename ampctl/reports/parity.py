"""Accuracy parity across seeds: does a mode match fp32's held-out metric, as the mixed-precision papers claim?

Each seed trains every mode from the same initialisation on the same batches, so the seeds pair the runs: the
difference of a mode from the baseline is the mean over seeds of (mode - baseline), with a 95% Student-t interval
for that mean. What counts as "the same" is the baseline's own seed noise: the standard deviation of its metric
across the seeds, the spread any run has just from its seed. A mode **matches** where the whole interval of the
difference lies within that noise, **differs** where the whole interval lies beyond it, and otherwise the seeds
do not decide (more seeds narrow the interval). One seed gives the difference and no verdict.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

# Student's t, the 97.5% quantile, by degrees of freedom (a two-sided 95% interval)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom: tabulated, or that of the next smaller
    tabulated df (a slightly wider interval, never a narrower one)."""
    return T_975[max(d for d in T_975 if d <= df)]


@dataclass(frozen=True)
class Parity:
    difference: float  # mean over seeds of mode - baseline
    half_width: Optional[float]  # of its 95% interval; None for one seed
    seed_sd: Optional[float]  # the baseline's standard deviation across seeds; None for one seed
    seeds: int

    @property
    def verdict(self) -> str:
        """matches | differs | undecided | one seed"""
        if self.half_width is None or self.seed_sd is None:
            return "one seed"
        if abs(self.difference) + self.half_width <= self.seed_sd:
            return "matches"
        if abs(self.difference) - self.half_width > self.seed_sd:
            return "differs"
        return "undecided"


def parity(baseline: Sequence[float], mode: Sequence[float]) -> Optional[Parity]:
    """The paired comparison of a mode's per-seed metric with the baseline's (same seeds, same order)."""
    pairs = [(b, m) for b, m in zip(baseline, mode) if math.isfinite(b) and math.isfinite(m)]
    if not pairs:
        return None
    differences = [m - b for b, m in pairs]
    n = len(pairs)
    if n < 2:
        return Parity(differences[0], None, None, 1)
    half = t_975(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return Parity(statistics.fmean(differences), half, statistics.stdev(b for b, _ in pairs), n)


def words(mode: str, baseline: str, metric: str, result: Optional[Parity]) -> str:
    """The verdict as the table's note says it."""
    if result is None:
        return f"{mode}: no finite held-out {metric} to compare with {baseline}"
    if result.verdict == "one seed":
        return (f"{mode}: held-out {metric} {result.difference:+.4f} against {baseline} with one seed: no verdict "
                "(compare.seeds=3 or more gives one)")
    difference = f"{result.difference:+.4f} ± {result.half_width:.4f}"
    noise = f"seed-to-seed sd of {baseline}: {result.seed_sd:.4f}, {result.seeds} seeds"
    if result.verdict == "matches":
        return f"{mode} matches {baseline} within seed noise: held-out {metric} {difference} ({noise})"
    if result.verdict == "differs":
        return f"{mode} differs from {baseline}: held-out {metric} {difference}, beyond seed noise ({noise})"
    return (f"{mode} vs {baseline}: held-out {metric} {difference}, not decided by {result.seeds} seeds ({noise}); "
            "more seeds narrow the interval")
