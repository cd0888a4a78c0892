"""Progress of the commands that measure rather than train (memory, inspect): one line per finished phase,
with its seconds, so that a long measurement is never a silent terminal (or CI log)."""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console

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
