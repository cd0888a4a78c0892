"""The loss scale's story, told as it happens: a line for each skipped step (consecutive skips as one line) and
each growth of the scale, said above the live view (or between the plain lines) and in train.log, and one line
at the end: where the scale started and ended, its lowest, the skips, backoffs and growths. The live view shows
only the latest step; these lines are what is left on the screen of a run's loss scaling.

A sink: it reads the records the run has anyway, on log steps (never the device), so a step's line comes with
its log interval. A run without a scaler (a scale of 1, no skips) tells nothing.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from ampctl.engine.telemetry import StepRecord
from ampctl.io import count_of, scale_label

MAX_EVENT_LINES = 50  # a run that skips or grows every few steps says the first ones; metrics.jsonl has all


class ScaleStory:
    def __init__(self, tell: Callable[[str], None]) -> None:
        self.tell = tell
        self.previous: Optional[StepRecord] = None
        self.burst: Optional[tuple[StepRecord, StepRecord]] = None  # the first and last of consecutive skips
        self.clean_since: Optional[int] = None  # the first step after the latest skip or scale change
        self.first: Optional[StepRecord] = None
        self.lowest = float("inf")
        self.skipped = self.backoffs = self.growths = 0
        self.nonfinite_losses = 0  # skipped steps whose loss itself was not finite (the forward pass's, unscaled)
        self.first_skip: Optional[int] = None
        self.told = 0

    def write(self, records: list[StepRecord]) -> None:
        for record in records:
            self._add(record)

    def _add(self, r: StepRecord) -> None:
        prev = self.previous
        self.first = self.first or r
        self.lowest = min(self.lowest, r.loss_scale)
        if prev is not None and r.loss_scale != prev.loss_scale:
            self.backoffs += r.loss_scale < prev.loss_scale
            self.growths += r.loss_scale > prev.loss_scale
        if prev is not None and not prev.skipped and r.loss_scale != prev.loss_scale:  # grew (or was set) after prev
            n = None if self.clean_since is None else r.step - self.clean_since
            clean = "" if n is None else f" ({count_of(n, 'clean step')})"
            self._say(f"after step {prev.step}: loss scale {scale_label(prev.loss_scale)} -> "
                      f"{scale_label(r.loss_scale)}{clean}")
        if self.burst is not None and not r.skipped:
            self._tell_burst(r.loss_scale)
        if r.skipped:
            self.skipped += 1
            self.nonfinite_losses += not math.isfinite(r.loss)
            self.first_skip = self.first_skip or r.step
            self.burst = (self.burst[0] if self.burst else r, r)
        if not r.skipped and (prev is None or prev.skipped or r.loss_scale != prev.loss_scale):
            self.clean_since = r.step
        self.previous = r

    def _tell_burst(self, scale_after: Optional[float]) -> None:
        """The open burst of skips, with the scale the step after it used (None: the run ended in it)."""
        assert self.burst is not None
        first, last = self.burst
        self.burst = None
        steps = f"step {first.step}" if first is last else f"steps {first.step}-{last.step}"
        if scale_after is None:  # the run ended in the burst: the scale its last step used, if it moved
            then = "" if last.loss_scale == first.loss_scale else \
                f"; scale {scale_label(last.loss_scale)} at step {last.step}"
        elif scale_after == first.loss_scale:
            then = "; scale kept"
        else:
            then = f"; scale -> {scale_label(scale_after)}"
        self._say(f"{steps} skipped: gradients not finite at scale {scale_label(first.loss_scale)}{then}")

    def _say(self, line: str) -> None:
        self.told += 1
        if self.told <= MAX_EVENT_LINES:
            self.tell(line)
        elif self.told == MAX_EVENT_LINES + 1:
            self.tell(f"(more skips and scale changes than {MAX_EVENT_LINES} lines: metrics.jsonl has every step; "
                      "the summary at the end counts them)")

    def close(self) -> None:
        """The loop ended: a burst of skips it ended in is told."""
        if self.burst is not None:
            self._tell_burst(None)

    def summary(self, final_scale: Optional[float] = None) -> Optional[str]:
        """One line of the whole story, or None for a run that never scaled its loss. final_scale: the scale after
        the last step's update (the summary's), which no record holds: a skip on the last step backs off there."""
        first, last = self.first, self.previous
        if first is None or last is None or (self.skipped == 0 and first.loss_scale == last.loss_scale == 1):
            return None
        end = last.loss_scale if final_scale is None else final_scale
        backoffs = self.backoffs + (end < last.loss_scale)
        growths = self.growths + (end > last.loss_scale)
        lowest_seen = min(self.lowest, end)
        if first.loss_scale == end and lowest_seen == first.loss_scale:
            scales = f"{scale_label(first.loss_scale)} throughout"
        else:
            lowest = lowest_seen < min(first.loss_scale, end)
            scales = (f"{scale_label(first.loss_scale)} -> {scale_label(end)}"
                      + (f" (lowest {scale_label(lowest_seen)})" if lowest else ""))
        skips = (f"{self.skipped:,} skipped (first at step {self.first_skip})" if self.skipped else "no step skipped")
        changes = [count_of(n, what) for n, what in ((backoffs, "backoff"), (growths, "growth")) if n]
        return f"loss scale {scales}: {skips}" + (f", {', '.join(changes)}" if changes else "")
