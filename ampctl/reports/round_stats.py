"""Step times measured in alternating rounds, and what they allow to be said.

`ampctl compare` runs its modes in turns: after the warm-up, round r runs a window of steps of every mode, one
mode at a time, so that what else the machine does falls on all of them alike. Each mode's round gives one
figure, the median step time of its window (the window's first step left out: it runs on caches another mode
left). The speedup of a mode is the median of its round-by-round ratios to the baseline (rounds taken side by
side, which load slows alike), with a distribution-free interval for that median from the order statistics of
the ratios (with 5 rounds, their minimum and maximum: 94% coverage). A mode is called faster or slower only
where that interval excludes 1; otherwise there is no measurable difference.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from ampctl.io import milliseconds

CONFIDENCE = 0.9  # the interval's coverage, at least
# A mode whose slowest round's median is this many times its fastest one's was measured on a busy machine: on a
# quiet one the rounds of a mode agree within a few percent.
BUSY_SPREAD = 1.25
# With many short rounds (compare's turns of 3 timed steps) their extremes spread on a quiet machine too (1.45x over
# 47 rounds of a small GPT on 2 quiet cores, 8-11x beside two busy loops): their 10th and 90th percentiles instead
# (1.27-1.30x quiet, 2.1-8.3x busy), from MANY_ROUNDS rounds on.
MANY_ROUNDS, BUSY_SPREAD_OF_MANY = 10, 1.6


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    def words(self, digits: int = 2) -> str:
        return f"{self.value:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


def windows(warmup_steps: int, steps: int, rounds: int) -> list[tuple[int, int]]:
    """The steps of each round, (first, last) inclusive: the steps after the warm-up in `rounds` windows of equal
    length (the last one takes the remainder)."""
    timed = steps - warmup_steps
    size = timed // rounds
    bounds = [warmup_steps + size * r for r in range(rounds)] + [steps]
    return [(bounds[r] + 1, bounds[r + 1]) for r in range(rounds)]


def round_medians(rows: Sequence[dict], spans: Sequence[tuple[int, int]], key: str = "step_time_ms",
                  untimed: Sequence[int] = ()) -> list[Optional[float]]:
    """Each round's median of rows[key] over its window, the window's first step and the untimed steps (those that
    compiled) left out; None for a round the run did not reach."""
    by_step = {r["step"]: r for r in rows}
    medians: list[Optional[float]] = []
    for first, last in spans:
        values = [by_step[s][key] for s in range(first + 1, last + 1)
                  if s in by_step and s not in untimed and by_step[s].get(key) is not None]
        medians.append(statistics.median(values) if values else None)
    return medians


def median_interval(values: Sequence[float]) -> Interval:
    """The median of values with a distribution-free confidence interval for it: their k-th smallest and k-th
    largest, k the largest that keeps the coverage at CONFIDENCE (at least 1: their minimum and maximum)."""
    ordered = sorted(values)
    k = _order(len(ordered))
    return Interval(statistics.median(ordered), ordered[k - 1], ordered[len(ordered) - k])


def coverage(n: int) -> float:
    """The probability that median_interval of n values holds their distribution's median."""
    return 1 - 2 * _binomial_cdf(_order(n) - 1, n)


def _order(n: int) -> int:
    """k of median_interval: [x_(k), x_(n+1-k)] covers the median with probability 1 - 2 P(Binomial(n, 1/2) < k)."""
    k = 1
    while k + 1 <= n // 2 and 1 - 2 * _binomial_cdf(k, n) >= CONFIDENCE:
        k += 1
    return k


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def spread(values: Sequence[float]) -> Interval:
    """A mode's step time: the median of its rounds, with their minimum and maximum."""
    return Interval(statistics.median(values), min(values), max(values))


def speedup(baseline_ms: Sequence[Optional[float]], mode_ms: Sequence[Optional[float]]) -> Optional[Interval]:
    """The mode's speedup over the baseline (baseline time / mode time), round by round; None without a round
    both ran."""
    ratios = [b / m for b, m in zip(baseline_ms, mode_ms) if b is not None and m is not None and m > 0]
    return median_interval(ratios) if ratios else None


def direction(ratio: Optional[Interval], rounds: int) -> Optional[str]:
    """"faster" or "slower" where the speedup's interval excludes 1, "no diff" where it holds 1; None where nothing
    can be said (no round, or one round: no interval)."""
    if ratio is None or rounds < 2:
        return None
    return "faster" if ratio.low > 1 else "slower" if ratio.high < 1 else "no diff"


def verdict(mode: str, baseline: str, ratio: Optional[Interval], rounds: int) -> str:
    """The speedup in words, claimed only where its interval excludes 1."""
    if ratio is None:
        return f"{mode}: no rounds to compare with {baseline}"
    said = direction(ratio, rounds)
    if said is None:
        return (f"{mode}: {ratio.value:.2f}x the speed of {baseline} in one round, no interval: nothing can be said "
                "of it (compare.rounds=5 measures one)")
    interval = f"{ratio.low:.2f}-{ratio.high:.2f}, {coverage(rounds):.0%} interval over {rounds} rounds"
    if said == "faster":
        return f"{mode} {ratio.value:.2f}x faster than {baseline} ({interval})"
    if said == "slower":
        return f"{mode} {1 / ratio.value:.2f}x slower than {baseline} ({ratio.value:.2f}x its speed; {interval})"
    return f"{mode}: no measurable difference from {baseline} ({ratio.value:.2f}x; {interval})"


def busy_rounds(by_mode: dict[str, Sequence[Optional[float]]]) -> Optional[str]:
    """Why the rounds cannot be trusted, when a mode's rounds disagree beyond the usual spread; None otherwise."""
    worst = None
    for mode, values in by_mode.items():
        measured = sorted(v for v in values if v is not None)
        if len(measured) < 2 or measured[0] <= 0:
            continue
        if len(measured) >= MANY_ROUNDS:
            tenths = statistics.quantiles(measured, n=10)
            low, high, limit, which = tenths[0], tenths[-1], BUSY_SPREAD_OF_MANY, "10th-90th percentile of its "
        else:
            low, high, limit, which = measured[0], measured[-1], BUSY_SPREAD, ""
        if high / low > limit and (worst is None or high / low > worst[1]):
            worst = (mode, high / low, low, high, which)
    if worst is None:
        return None
    mode, disagreement, low, high, which = worst
    return (f"the rounds disagree beyond the usual spread ({mode}'s {which}round medians "
            f"{milliseconds(low)}-{milliseconds(high)} ms, "
            f"{disagreement:.2f}x apart): the machine was busy while it measured; the intervals are wide for it; "
            "run again when it is quiet, or raise compare.rounds")
