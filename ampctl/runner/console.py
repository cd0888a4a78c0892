"""What the user sees: a rich live view on a terminal, one plain line per log interval otherwise.

Rendering only: the sinks here receive finished StepRecords and never reach into the loop.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from ampctl import io
from ampctl.conf.schema import ConsoleMode
from ampctl.engine.telemetry import StepRecord


def human_rate(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.1f}"


class _Latest:
    """The numbers both renderers show, folded from the records so far."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens
        self.record: Optional[StepRecord] = None
        self.last_skipped: Optional[int] = None
        self.skipped_in_interval = 0

    def update(self, records: list[StepRecord]) -> None:
        self.record = records[-1]
        skipped = [r.step for r in records if r.skipped]
        self.skipped_in_interval = len(skipped)
        if skipped:
            self.last_skipped = skipped[-1]

    def throughput(self) -> str:
        r = self.record
        assert r is not None
        if self.tokens and r.tokens_per_s is not None:
            return f"{human_rate(r.tokens_per_s)} tok/s"
        return f"{human_rate(r.samples_per_s)} samples/s"

    def mfu(self) -> str:
        """Model FLOPs utilization of the latest step, against the peak summary.json names."""
        r = self.record
        return "-" if r is None or r.mfu is None else f"{r.mfu:.1%}"


def say(line: str) -> None:
    """print() a line. If the reader has gone (`ampctl train ... | head`), training and recording go on and
    the rest of the output goes to /dev/null, the pattern the Python docs give for SIGPIPE."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class PlainConsole:
    """One line per log interval, for CI logs and pipes."""

    def __init__(self, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]]) -> None:
        self.total = total_steps
        self.latest = _Latest(tokens)
        self.peak_memory = peak_memory

    def write(self, records: list[StepRecord]) -> None:
        self.latest.update(records)
        r = self.latest.record
        assert r is not None
        last = "-" if self.latest.last_skipped is None else str(self.latest.last_skipped)
        say(
            f"step {r.step}/{self.total} | loss {r.loss:.4f} | scale {r.loss_scale:g} | "
            f"skipped {r.skipped_total} (last {last}) | grad_norm {r.grad_norm:.3g} | lr {r.lr:.3g} | "
            f"{self.latest.throughput()}{'' if r.mfu is None else f' | MFU {self.latest.mfu()}'} | "
            f"{r.step_time_ms:.1f} ms/step | peak {io.format_bytes(self.peak_memory(), decimals=1)}"
        )

    def close(self) -> None:
        pass


class LiveConsole:
    """A progress bar with ETA over a table of the latest step's numbers; skipped steps in red."""

    def __init__(
        self, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]], console: Console
    ) -> None:
        self.latest = _Latest(tokens)
        self.peak_memory = peak_memory
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task("train", total=total_steps)
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self.live.start()

    def _render(self) -> Group:
        table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
        columns = ("step", "loss", "loss scale", "skipped", "grad norm", "lr", "throughput", "MFU", "step time",
                   "peak mem")
        for column in columns:
            table.add_column(column, justify="right")
        r = self.latest.record
        if r is None:
            table.add_row(*(["-"] * len(columns)))
        else:
            skipped = Text(f"{r.skipped_total}")
            if self.latest.last_skipped is not None:
                skipped.append(f" (last {self.latest.last_skipped})")
            if self.latest.skipped_in_interval:
                skipped.stylize("bold red")
            table.add_row(
                str(r.step),
                f"{r.loss:.4f}",
                f"{r.loss_scale:g}",
                skipped,
                f"{r.grad_norm:.3g}",
                f"{r.lr:.3g}",
                self.latest.throughput(),
                self.latest.mfu(),
                f"{r.step_time_ms:.1f} ms",
                io.format_bytes(self.peak_memory(), decimals=1),
            )
        return Group(self.progress, table)

    def write(self, records: list[StepRecord]) -> None:
        self.latest.update(records)
        self.progress.update(self.task, completed=records[-1].step)
        self.live.update(self._render(), refresh=True)

    def close(self) -> None:
        self.live.stop()


def make_console_sink(
    mode: ConsoleMode, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]]
) -> Optional[object]:
    if mode is ConsoleMode.quiet:
        return None
    console = Console()
    live = mode is ConsoleMode.live or (mode is ConsoleMode.auto and console.is_terminal and sys.stdout.isatty())
    if live:
        return LiveConsole(total_steps, tokens, peak_memory, console)
    return PlainConsole(total_steps, tokens, peak_memory)
