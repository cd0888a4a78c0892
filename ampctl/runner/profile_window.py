"""The window of steps train.profile=N profiles (runner/profiling.py profiles them): where it starts, and its
refusal where it would end past the run, made by the plan before anything is written."""

from __future__ import annotations

from typing import Optional

from ampctl.errors import UsageError

PROFILER_WARMUP_STEPS = 1  # torch.profiler's own warm-up: its first traced step carries the tracer's start-up


def first_profiled_step(profile: Optional[int], steps: int, settled: int, start_step: int = 0) -> int:
    """The first step train.profile=N profiles: past the run's `settled` steps that are not timed (its timing
    warm-up, the CPU memory measurement, a compiling first step) and the profiler's own warm-up step. Refused
    (UsageError, before anything is written) when the run ends before the window does: a run's, and each of
    ampctl compare's modes' before any runs."""
    first = start_step + settled + PROFILER_WARMUP_STEPS + 1
    if profile is not None and first + profile - 1 > steps:
        raise UsageError(
            f"train.profile={profile}: the profiled steps would be {first}-{first + profile - 1}, past train.steps="
            f"{steps} (the run {'resumes at step ' + str(start_step) + ' and ' if start_step else ''}"
            f"leaves out {settled} warm-up step(s), then the profiler warms up for {PROFILER_WARMUP_STEPS}); "
            f"raise train.steps to {first + profile - 1} or more, or lower train.profile")
    return first
