"""Progress of the commands that measure rather than train (memory, inspect, diff): one line per finished phase,
with its seconds, and within a long phase a bar with the time left (a terminal) or a line every few seconds (a
log), so that a long measurement is never a silent terminal (or CI log)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ampctl.reports.tables import print_line


class Phases:
    """`Phases(console)("built the model")` prints `    built the model (2.1 s)`: the time since the last line."""

    def __init__(self, console: Console, indent: str = "    ") -> None:
        self.console, self.indent = console, indent
        self._since = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        print_line(self.console, f"{self.indent}{what} ({now - self._since:.1f} s)", highlight=False)
        self._since = now

    def steps(self, total: int, what: str = "step") -> Callable[[int], None]:
        """An after_step callback for engine.loop.run_steps: `step 2/3 (0.4 s)`."""
        return lambda done: self(f"{what} {done}/{total}")


LOG_EVERY_S = 10.0  # off a terminal, a line within a phase this often (a CI log shows the phase is moving)


@contextlib.contextmanager
def ticking(console: Console, total: int, what: str, indent: str = "    ") -> Iterator[Callable[[int, str], None]]:
    """Within a phase of `total` units: tick(done, where) after each. On a terminal a bar with the time left after
    `where` (`batch 2/8, layer 30/74`: short, so that the bar fits 80 columns whole), gone when the phase ends; off
    one a line every LOG_EVERY_S seconds."""
    if console.is_terminal:
        with Progress(TextColumn(f"{indent}{{task.description}}"), BarColumn(bar_width=20), TimeElapsedColumn(),
                      TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True) as progress:
            task = progress.add_task(what, total=total)
            yield lambda done, where: progress.update(task, completed=done, description=where)
        return
    started = last = time.perf_counter()

    def tick(done: int, where: str) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= LOG_EVERY_S and done < total:
            left = (now - started) / done * (total - done)
            print_line(console, f"{indent}{what}: {where}, {done}/{total} ({now - started:.0f} s, about {left:.0f} s "
                                "left)", highlight=False)
            last = now

    yield tick
