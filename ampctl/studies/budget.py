"""How `ampctl advise` keeps to advise.budget: a clock from the command's start, and each phase sized to what is
left of it when the phase starts (pure functions of the measured fp32 step, tested on figures).

A budget is a promise. The calibration (a few fp32 steps) comes first, so that every later phase is sized from
the step this machine takes now: the inspection takes the inspected steps that fit its share (none: skipped, said);
the comparison takes the steps that fit what is left, then fewer seeds, then fewer modes (the costliest first),
and is not run where fp32 and one other mode cannot fit. What the estimate misses (a machine that gets busy) the
deadline catches: the inspection stops between its steps, the comparison's runs are stopped as by SIGTERM. What
may run past the budget is MARGIN_S: the step each run is in, its checkpoint, and the reports.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

CALIBRATION_STEPS = 8  # fp32 steps (2 of them warm-up) that time the step here
# The comparison's runs are forked from a server that imports torch and ampctl once (preloaded.py),
# measured here on 2 cores: the server and its first run of the mlp 6.0 s, each later run 0.7-0.9 s to the end of
# its first steps (a fresh interpreter: 6.8 s). Both rounded up for bigger recipes' builds.
SERVER_START_S = 7.0  # once per comparison: the server's imports
PROCESS_START_S = 2.0  # each run's process: forked, its build and first steps
MIN_STEPS, MAX_STEPS = 30, 2000  # a compared run's steps: fewer give neither an interval nor a held-out verdict
MIN_SEEDS = 2  # parity with fp32 is judged against seed-to-seed noise: one seed decides nothing
COMPILED_MIN_STEPS = 2 * MIN_STEPS  # compile is measured only where each run keeps at least this many steps
PLANNED_SHARE = 0.9  # of the budget left: the rest for what the estimate leaves out (evaluations, reports)
INSPECT_SHARE = 0.25  # of the budget left: the inspection's (a mode's inspection in FP8 or MX too)
INSPECTED_STEP_COST = 25.0  # an inspected step against a plain one (range hooks on every leaf: 17-25x measured)
INSPECT_FIXED_S = 4.0  # an inspection beyond its steps: hooks, tables, two plots (2-4 s measured here)
MARGIN_S = 30.0  # past the budget at most: the step each run is in, its checkpoint, the reports and plots


def seconds_since_start() -> float:
    """How long this process has run (its imports included), from the kernel's record of its start; 0 where that
    cannot be read."""
    try:
        fields = open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, after the comm field: clock ticks since boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class BudgetClock:
    """advise's time against its budget, from the command's start: each phase's line starts `[1:05 of 10:00]`."""

    def __init__(self, budget_s: float, already_s: float = 0.0) -> None:
        self.budget_s, self._started = budget_s, time.monotonic() - already_s

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def left(self) -> float:
        return max(self.budget_s - self.elapsed(), 0.0)

    def deadline(self, share: float = 1.0) -> float:
        """The time.monotonic() by which `share` of what is left is spent."""
        return time.monotonic() + share * self.left()

    def line(self, text: str) -> str:
        return f"[{minutes(self.elapsed())} of {minutes(self.budget_s)}] {text}"


def minutes(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 60}:{whole % 60:02d}"


def inspected_steps(wanted: int, step_s: float, seconds: float, relative: float = 1.0) -> int:
    """How many of `wanted` inspected steps fit in `seconds` (0: the inspection does not fit), a plain step taking
    step_s in fp32 and the mode's step `relative` times that."""
    per_step = INSPECTED_STEP_COST * relative * step_s
    if per_step <= 0:
        return wanted
    return max(0, min(wanted, math.floor((seconds - INSPECT_FIXED_S) / per_step)))


@dataclass(frozen=True)
class Candidate:
    """A run of the comparison, as its cost is estimated: its step against fp32's, and whether it compiles."""

    label: str
    relative: float = 1.0
    compiled: bool = False
    baseline: bool = False  # fp32: never dropped, every other mode is measured against it


@dataclass
class ComparisonSize:
    """What fits: the runs kept, their steps and seeds, the estimate, and what was given up (said as notes)."""

    kept: list[str]
    steps: int = 0
    seeds: int = 0
    estimate_s: float = 0.0
    dropped: dict[str, str] = field(default_factory=dict)  # a candidate left out -> why
    fewer_seeds: Optional[str] = None
    # where fp32 and another mode did not fit with MIN_SEEDS seeds: the seconds that would compare them so
    needed_s: Optional[float] = None

    @property
    def runs(self) -> bool:
        return len(self.kept) > 1


def estimate(candidates: Sequence[Candidate], step_s: float, seeds: int, compile_s: float = 0.0,
             seconds: Optional[float] = None, steps: Optional[int] = None) -> tuple[int, float]:
    """The steps a run takes so that the comparison fits `seconds` (or the given steps), and its seconds: the
    process server's start, then per seed each run's process start and compile, then every run's steps (its step
    `relative` times fp32's)."""
    fixed_s = SERVER_START_S + seeds * sum(PROCESS_START_S + (compile_s if c.compiled else 0.0) for c in candidates)
    per_step_s = seeds * sum(c.relative for c in candidates) * step_s
    if steps is None:
        assert seconds is not None
        steps = MAX_STEPS if per_step_s <= 0 else min(MAX_STEPS, math.floor(max(seconds - fixed_s, 0) / per_step_s))
    return steps, fixed_s + steps * per_step_s


def size_comparison(candidates: Sequence[Candidate], step_s: float, seconds: float, seeds: int,
                    compile_s: float = 0.0, min_steps: int = MIN_STEPS) -> ComparisonSize:
    """The largest comparison that fits `seconds`: every candidate with the seeds asked for, each run at least
    min_steps; else fewer seeds (down to MIN_SEEDS); else without the costliest candidate, and so on. Where fp32
    and one other cannot fit with MIN_SEEDS seeds: the two with one seed (the speed measured, the accuracy not
    decided), else not run (kept: fp32 alone); either way the seconds that would compare them over MIN_SEEDS."""
    size = _largest_that_fits(candidates, step_s, seconds, seeds, compile_s, min_steps)
    if size.runs or len(candidates) < 2 or seeds < MIN_SEEDS:
        return size
    cheapest = min((c for c in candidates if not c.baseline),
                   key=lambda c: c.relative * step_s * min_steps + (compile_s if c.compiled else 0.0))
    pair = [c for c in candidates if c.baseline or c is cheapest]
    needed_s = estimate(pair, step_s, MIN_SEEDS, compile_s, steps=min_steps)[1]
    steps, seconds_needed = estimate(pair, step_s, 1, compile_s, seconds)
    if steps < min_steps:
        return dataclasses.replace(size, needed_s=needed_s)
    dropped = {label: why for label, why in size.dropped.items() if label != cheapest.label}
    return ComparisonSize([c.label for c in pair], steps, 1, seconds_needed, dropped,
                          f"1 seed of compare.seeds={seeds}: {MIN_SEEDS} would leave fewer than {min_steps} steps a "
                          "run; its speed is measured, its accuracy against fp32 is not decided", needed_s)


def _largest_that_fits(candidates: Sequence[Candidate], step_s: float, seconds: float, seeds: int,
                       compile_s: float, min_steps: int) -> ComparisonSize:
    kept, dropped = list(candidates), {}
    fewest = min(seeds, MIN_SEEDS)
    while len(kept) > 1:
        for n in range(seeds, fewest - 1, -1):
            steps, seconds_needed = estimate(kept, step_s, n, compile_s, seconds)
            if steps >= min_steps:
                fewer = None if n == seeds else (
                    f"{n} seeds of compare.seeds={seeds}: {seeds} would leave fewer than {min_steps} steps a run")
                return ComparisonSize([c.label for c in kept], steps, n, seconds_needed, dropped, fewer)
        others = [c for c in kept if not c.baseline]
        if not others:
            break
        costliest = max(others, key=lambda c: (c.relative * step_s * min_steps + (compile_s if c.compiled else 0.0)))
        kept.remove(costliest)
        dropped[costliest.label] = (
            f"not compared in the budget: with it, {min_steps} steps a run over {fewest} seeds would not fit the "
            f"{minutes(seconds)} left" + (f" (its step: ~{costliest.relative:.3g}x fp32's here)"
                                          if costliest.relative != 1.0 else ""))
    return ComparisonSize([c.label for c in kept], dropped=dropped)
