"""Numeric guards, checked on the step records as they come back from the device (log steps only, so the
training step never syncs for them; every step's record is checked): too many skipped steps in a row, an overflow
at the minimum loss scale, a non-finite loss that no loss scaler can absorb, and (guard.loss_spike) a finite loss
spike: a loss far above the median of the steps before it, by their own robust spread."""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from ampctl.conf.schema import NonfiniteAction
from ampctl.engine.telemetry import StepRecord


@dataclass
class GuardTrip:
    step: int  # the step to replay: the first bad one
    reason: str
    spike_above: Optional[float] = None  # a loss spike's: the loss beyond which a step's loss was a spike


class GuardStop(Exception):
    def __init__(self, trip: GuardTrip) -> None:
        super().__init__(trip.reason)
        self.trip = trip


class Guard:
    def __init__(self, cfg: DictConfig, can_skip: bool, min_scale: Optional[float]) -> None:
        self.max_skips = cfg.max_consecutive_skips
        self.stop_at_min_scale = cfg.stop_at_min_scale and min_scale is not None
        self.on_nonfinite: NonfiniteAction = cfg.on_nonfinite
        self.can_skip = can_skip
        self.min_scale = min_scale
        self.streak_start: Optional[int] = None
        self.streak = 0
        self.spike: Optional[float] = cfg.get("loss_spike")
        self.window: collections.deque[float] = collections.deque(maxlen=cfg.get("loss_spike_window", 50))

    def prime(self, earlier: list[StepRecord]) -> None:
        """The records of the steps before this process's first (a resumed run's own, or those before the checkpoint
        an escalation went back to): every state that decides a trip goes on from them, as in the process that
        recorded them, instead of starting again: the streak of skipped steps (a run stopped inside one trips where
        it would have, at the streak's first step) and the spike watch's window. A checkpoint is written after its
        step's checks, so these records tripped nothing under the run's settings."""
        for r in earlier:
            self._follow_streak(r)
            if not r.skipped and math.isfinite(r.loss):
                self.window.append(r.loss)

    def _follow_streak(self, r: StepRecord) -> None:
        if r.skipped:
            self.streak_start = r.step if self.streak == 0 else self.streak_start
            self.streak += 1
        else:
            self.streak = 0

    def check(self, records: list[StepRecord]) -> tuple[Optional[GuardTrip], list[str]]:
        """The first trip in these records (if any), and warnings to print."""
        warnings = []
        for r in records:
            # The loss, not the grad norm: a norm can overflow fp32 while every gradient is finite.
            if not self.can_skip and not math.isfinite(r.loss):
                message = (f"non-finite loss {r.loss} at step {r.step}, and this precision mode has no loss "
                           "scaler to skip the step: the weights are no longer finite")
                if self.on_nonfinite is NonfiniteAction.stop:
                    return GuardTrip(r.step, message), warnings
                if not warnings:
                    warnings.append(message + " (guard.on_nonfinite=warn: training on)")
                continue
            self._follow_streak(r)
            if self.stop_at_min_scale and r.skipped and r.loss_scale <= self.min_scale * (1 + 1e-6):  # type: ignore[operator]
                trip = GuardTrip(r.step, f"step {r.step} overflowed at the minimum loss scale "
                                         f"(scaler.min_scale={self.min_scale:g}): the scale cannot back off further")
                return trip, warnings
            if self.spike is not None and not r.skipped and math.isfinite(r.loss):
                spike = self._spike(r)
                if spike is not None:
                    return spike, warnings
            if self.max_skips is not None and self.streak >= self.max_skips:
                return GuardTrip(self.streak_start or r.step, f"{self.streak} consecutive skipped steps "
                                 f"({self.streak_start}..{r.step}), loss scale now {r.loss_scale:g}: the run is "
                                 "not recovering (guard.max_consecutive_skips)"), warnings
        return None, warnings

    def _spike(self, r: StepRecord) -> Optional[GuardTrip]:
        """The loss of a step against the last window's: a trip where it is more than guard.loss_spike robust
        deviations above their median; the loss joins the window otherwise. Nothing until the window is full."""
        if len(self.window) == self.window.maxlen:
            median = statistics.median(self.window)
            spread = 1.4826 * statistics.median(abs(v - median) for v in self.window)
            # a loss flat to within 1% has no meaningful spread: 1% of it stands for one
            deviation = max(spread, 0.01 * abs(median))
            z = (r.loss - median) / deviation if deviation > 0 else 0.0
            if z > self.spike:  # type: ignore[operator]
                return GuardTrip(r.step, f"loss spike at step {r.step}: {r.loss:.4g}, {z:.1f} robust deviations "
                                         f"above the median {median:.4g} of the {len(self.window)} steps before it "
                                         f"(guard.loss_spike={self.spike:g})",
                                 spike_above=median + self.spike * deviation)  # type: ignore[operator]
        self.window.append(r.loss)
        return None
