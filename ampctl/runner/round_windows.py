"""A run's windows in `ampctl compare`'s rounds: the child side of studies/rounds.py.

In each round every mode runs a window of steps while the others wait. compare starts each mode's `ampctl train`
with ROUND_ENDS_ENV (the steps that end its windows) and ROUND_FD_ENV (a pipe to say it waits). At each of those
steps the run writes its rows (its window is in metrics.jsonl), says `paused STEP` on the pipe and waits for a
line on its stdin; then it goes on, timing its next step from then: the wait is no step's time. End of input on
stdin (compare interrupted, or gone) means go on without waiting again. Without the variables nothing of this
exists: a run alone never waits.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from ampctl.engine.telemetry import Telemetry

ROUND_ENDS_ENV = "AMPCTL_ROUND_ENDS"  # "10,20,30"
ROUND_FD_ENV = "AMPCTL_ROUND_FD"


class RoundWindows:
    """The steps that end this run's windows, and the pipe on which it says it waits."""

    def __init__(self, after: set[int], fd: int) -> None:
        self.after, self.fd = after, fd

    @classmethod
    def from_env(cls) -> Optional["RoundWindows"]:
        steps, fd = os.environ.get(ROUND_ENDS_ENV), os.environ.get(ROUND_FD_ENV)
        if not steps or not fd:
            return None
        return cls({int(s) for s in steps.split(",")}, int(fd))

    def after_step(self, step: int, telemetry: Telemetry) -> None:
        if step not in self.after:
            return
        telemetry.flush()  # the window's rows are on disk before compare reads them
        try:
            os.write(self.fd, f"paused {step}\n".encode())
            resumed = sys.stdin.readline()
        except OSError:  # compare is gone: go on alone
            resumed = ""
        if not resumed:
            self.after = set()
        telemetry.timer.restart()
