"""Ctrl-C and SIGTERM during training: the first asks the loop to stop after the current step (it then
writes a checkpoint and flushes the metrics); the second exits at once. Checkpoints are written atomically,
so even that leaves every checkpoint on disk whole."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Optional


class Interrupted(Exception):
    def __init__(self, signum: int, step: int, checkpoint: Optional[str]) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopOnSignal:
    """SIGINT, SIGTERM and a batch system's preemption warning (train.preempt_signal): stop at the next step
    where the run can (after this step, or the next log step when ranks must agree), with a checkpoint."""

    def __init__(self, announce: str = "after this step", preempt_signal: Optional[str] = None) -> None:
        self.signals = [signal.SIGINT, signal.SIGTERM] + ([signal.Signals[preempt_signal]] if preempt_signal else [])
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        self._announce = announce  # when the run will stop; "" for a process that should not print

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, _frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            os._exit(128 + signum)  # second signal: now, without unwinding (nothing half-written survives)
        self.signum = signum
        if self._announce:
            print(f"\nampctl: {signal.Signals(signum).name}: stopping {self._announce} and writing a checkpoint "
                  "(again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
