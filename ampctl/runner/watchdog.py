"""Hang detection: a thread that names a run whose steps stopped finishing, and writes every thread's stack.

A step far slower than the run's own median (a dead data worker, a collective one rank never joins, a disk
that stopped answering) looks, from outside, like a run that is merely slow. After `train.cluster.hang_after_s`
seconds without a finished step, and at least HANG_FACTOR times the median step, the watchdog says so once
per stall, and writes the stack of every thread (faulthandler's, as torchelastic's watchdog and torchtitan's
timeouts dump them) to `hang-step-N.txt` in the run directory; the run goes on. The clock runs from the end
of one step's bookkeeping (checkpoint, evaluation, a compare turn's pause: not counted) to the end of the
next step; the host only, no device sync (the host waits for the device on log steps anyway).
"""

from __future__ import annotations

import contextlib
import faulthandler
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Optional

HANG_FACTOR = 20.0  # times the median step: a step this much slower is not noise
MIN_STEPS = 3  # steps timed before the median means anything (the first ones compile, warm up)


class Watchdog:
    def __init__(self, run_dir: Path, echo: Callable[[str], None], hang_after_s: Optional[float],
                 poll_s: float = 1.0) -> None:
        self.run_dir, self.echo, self.hang_after_s = run_dir, echo, hang_after_s
        self.poll_s = min(poll_s, hang_after_s / 4) if hang_after_s else poll_s
        self.step = 0
        self.started = time.monotonic()
        self.durations: deque[float] = deque(maxlen=100)
        self.reported_at: Optional[int] = None  # the step a stall was reported for
        self.paused = False
        self.reports: list[Path] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Watchdog":
        if self.hang_after_s:
            self._thread = threading.Thread(target=self._watch, name="ampctl-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def step_done(self, step: int) -> None:
        """After a step (before its checkpoint and evaluation)."""
        self.durations.append(time.monotonic() - self.started)
        self.step = step

    def bookkeeping_done(self) -> None:
        """After the step's checkpoint, evaluation and pause: the next step's clock starts."""
        self.started = time.monotonic()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """A wait that is not the run's (a comparison's other modes taking their turn)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False
            self.started = time.monotonic()

    def limit_s(self) -> Optional[float]:
        if not self.hang_after_s or len(self.durations) < MIN_STEPS:
            return None
        return max(self.hang_after_s, HANG_FACTOR * statistics.median(self.durations))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            limit, waited = self.limit_s(), time.monotonic() - self.started
            if limit is None or self.paused or waited < limit or self.reported_at == self.step:
                continue
            self.reported_at = self.step
            self._report(waited)

    def _report(self, waited: float) -> None:
        path = self.run_dir / f"hang-step-{self.step + 1}.txt"
        with path.open("w", encoding="utf-8") as f:
            f.write(f"step {self.step + 1}: no step finished for {waited:.1f} s (median step "
                    f"{statistics.median(self.durations) * 1e3:.1f} ms); the stack of every thread:\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        self.reports.append(path)
        median = statistics.median(self.durations)
        self.echo(f"warning: step {self.step + 1} has not finished after {waited:.0f} s, {waited / median:,.0f}x the "
                  f"median step ({median * 1e3:.1f} ms): a hang? every thread's stack is in {path}; the run goes on "
                  "(Ctrl-C stops it with a checkpoint)")
