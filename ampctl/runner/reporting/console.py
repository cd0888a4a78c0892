"""What the user sees: a rich live view on a terminal, one plain line per log interval otherwise.

Rendering only: the sinks here receive finished StepRecords and never reach into the loop.
"""

from __future__ import annotations

import collections
import datetime
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from ampctl import io, machine_load
from ampctl.conf.train_schema import ConsoleMode
from ampctl.engine.telemetry import StepRecord


def human_rate(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.1f}"


def format_duration(seconds: Optional[float]) -> str:
    """0:01:05, 12:00:00, 2 days, 3:04:05; '?' before there is anything to estimate from."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds >= 1e5 * 86400:  # past what a timedelta holds (train.steps=2^63-1): years are years
        return f"{seconds / (365.25 * 86400):.3g} years"
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class Pace:
    """The time the rest of the run will take: the steps left times the median step time so far (of the
    latest 1,000 steps, so that a run whose pace changed is estimated at its new pace). A step's time is known
    when it ends where the host clock is the step's (the CPU), else when its record comes back on a log step
    (CUDA events). The first step this process runs (warm-up, compilation) counts only until there is another."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self._first: Optional[float] = None
        self._step_ms: collections.deque[float] = collections.deque(maxlen=1000)
        self._counted_to = -1  # the last step whose time is counted

    def add(self, step: int, step_ms: Optional[float]) -> None:
        if step_ms is None or step <= self._counted_to:
            return
        self._counted_to = step
        if self._first is None:
            self._first = step_ms
        else:
            self._step_ms.append(step_ms)

    def add_records(self, records: list[StepRecord]) -> None:
        for r in records:
            self.add(r.step, r.step_time_ms)

    def remaining_s(self, step: int) -> Optional[float]:
        # a copy first (one C call): the live view's refresh thread reads while the loop appends
        times = list(self._step_ms)
        typical = statistics.median(times) if times else self._first
        return None if typical is None else (self.total - step) * typical / 1e3


class _Latest:
    """The numbers both renderers show, folded from the records so far."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens
        self.record: Optional[StepRecord] = None
        self.last_skipped: Optional[int] = None
        self.skipped_in_interval = 0
        self._load = machine_load.sample()
        self.others: Optional[float] = None  # the cores other processes took since the last records, when busy

    def update(self, records: list[StepRecord]) -> None:
        self.record = records[-1]
        skipped = [r.step for r in records if r.skipped]
        self.skipped_in_interval = len(skipped)
        if skipped:
            self.last_skipped = skipped[-1]
        now = machine_load.sample()  # a log step: the records came back from the device anyway
        others, self._load = machine_load.others_cores(self._load, now), now
        self.others = others if machine_load.busy(others) else None

    def throughput(self, why_busy: bool = False) -> str:
        """The latest rate; `(busy)` where other processes took a share of the machine meanwhile: not the run's
        speed alone (why_busy: how much of it they took)."""
        r = self.record
        assert r is not None
        busy = "" if self.others is None else f" (busy: {machine_load.said(self.others)})" if why_busy else " (busy)"
        if self.tokens and r.tokens_per_s is not None:
            return f"{human_rate(r.tokens_per_s)} tok/s{busy}"
        return f"{human_rate(r.samples_per_s)} samples/s{busy}"

    def mfu(self) -> str:
        """Model FLOPs utilization of the latest step, against the peak summary.json names."""
        r = self.record
        return "-" if r is None or r.mfu is None else f"{r.mfu:.1%}"


def say(line: str) -> None:
    """print() a line. If the reader has gone (`ampctl train ... | head`), training and recording go on and
    the rest of the output goes to /dev/null, the pattern the Python docs give for SIGPIPE."""
    try:
        print(io.for_the_terminal(line), flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


class PlainConsole:
    """One line per log interval (and one after the first step), for CI logs and pipes. scaled: the run has a loss
    scaler (a mode without one shows no scale: its "scale 1" was no scale's)."""

    def __init__(self, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]],
                 scaled: bool = True) -> None:
        self.total, self.scaled = total_steps, scaled
        self.latest = _Latest(tokens)
        self.pace = Pace(total_steps)
        self.peak_memory = peak_memory
        self.notes: dict[str, str] = {}  # what a log adds to the line (the experts' load: `load 1.42x`)

    def write(self, records: list[StepRecord]) -> None:
        self.latest.update(records)
        self.pace.add_records(records)
        r = self.latest.record
        assert r is not None
        last = "-" if self.latest.last_skipped is None else str(self.latest.last_skipped)
        say(
            f"step {r.step}/{self.total} | loss {r.loss:.4f} | "
            + (f"scale {io.scale_label(r.loss_scale)} | skipped {r.skipped_total} (last {last}) | " if self.scaled
               else "")
            + f"grad_norm {r.grad_norm:.3g} | lr {r.lr:.3g} | "
            f"{self.latest.throughput(why_busy=True)}{'' if r.mfu is None else f' | MFU {self.latest.mfu()}'} | "
            + "".join(f"{note} | " for note in self.notes.values())
            + f"{r.step_time_ms:.1f} ms/step | peak {io.format_bytes(self.peak_memory(), decimals=1)} | "
            f"eta {format_duration(self.pace.remaining_s(r.step))}"
        )

    def close(self) -> None:
        pass


class EtaColumn(ProgressColumn):
    """The time left at the latest step, less the time since it ended: it counts down between steps (a run of
    minute-long steps still shows time passing). Estimated when the view redraws (4 times a second), not at
    every step: the median is no work for the training step."""

    def __init__(self, pace: Pace) -> None:
        super().__init__()
        self.pace = pace

    def render(self, task: Task) -> Text:
        left = self.pace.remaining_s(int(task.completed))
        ended_at = task.fields.get("step_ended_at")
        if left is not None and ended_at is not None:
            left -= time.monotonic() - ended_at
        return Text(f"eta {format_duration(left)}", style="progress.remaining")


# The live table's columns, most important first: on a narrow terminal the last ones go, whole (a number cut
# to "1953…" is worse than no number).
LIVE_COLUMNS = ("step", "loss", "loss scale", "skipped", "throughput", "step time", "load", "grad norm", "peak mem",
                "lr", "MFU")


def fit_columns(cells: dict[str, Any], width: int, console: Console) -> Table:
    """A table of the cells (column -> value, in LIVE_COLUMNS' order of importance) that fits `width`
    characters: the least important columns are dropped until it does."""
    names = [name for name in LIVE_COLUMNS if name in cells]
    unbounded = console.options.update_width(10_000)  # the width the table wants, not what it would be cut to
    while True:
        table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1), pad_edge=False)
        kept = [name for name in LIVE_COLUMNS if name in names]  # shown in their reading order
        for name in kept:
            table.add_column(name, justify="right", no_wrap=True)
        table.add_row(*(cells[name] for name in kept))
        if len(names) == 1 or Measurement.get(console, unbounded, table).maximum <= width:
            return table
        names.pop()


class LiveConsole:
    """A progress bar that advances every step, with the time left from the median step time, over a table of
    the latest step's numbers (the first after step 1); skipped steps in red. Fits the terminal's width."""

    def __init__(
        self, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]], console: Console,
        scaled: bool = True
    ) -> None:
        self.console, self.scaled = console, scaled
        self.notes: dict[str, str] = {}  # what a log adds to the table (the experts' load: `load 1.42x`)
        self.latest = _Latest(tokens)
        self.pace = Pace(total_steps)
        self.peak_memory = peak_memory
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=None if console.width >= 100 else 20),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            EtaColumn(self.pace),
            console=console,
        )
        self.task = self.progress.add_task("train", total=total_steps, step_ended_at=None)
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self.live.start()

    def _cells(self) -> dict[str, Any]:
        r = self.latest.record
        unscaled = () if self.scaled else ("loss scale", "skipped")
        if r is None:
            return {name: "-" for name in LIVE_COLUMNS if name != "MFU" and name not in unscaled}
        skipped = Text(f"{r.skipped_total}")
        if self.latest.last_skipped is not None:
            skipped.append(f" (last {self.latest.last_skipped})")
        if self.latest.skipped_in_interval:
            skipped.stylize("bold red")
        cells = {
            "step": str(r.step),
            "loss": f"{r.loss:.4f}",
            "loss scale": io.scale_label(r.loss_scale),
            "skipped": skipped,
            "throughput": self.latest.throughput(),
            "step time": f"{r.step_time_ms:.1f} ms",
            "grad norm": f"{r.grad_norm:.3g}",
            "peak mem": io.format_bytes(self.peak_memory(), decimals=1),
            "lr": f"{r.lr:.3g}",
        }
        if r.mfu is not None:
            cells["MFU"] = self.latest.mfu()
        if "load" in self.notes:
            cells["load"] = self.notes["load"].removeprefix("load ")
        return {name: cell for name, cell in cells.items() if name not in unscaled}

    def _render(self) -> Group:
        return Group(self.progress, fit_columns(self._cells(), self.console.width, self.console))

    def step_done(self, step: int, step_ms: Optional[float] = None) -> None:
        """Every step, on the host: the bar's count and the time left (no device value is read)."""
        self.pace.add(step, step_ms)
        self.progress.update(self.task, completed=step, step_ended_at=time.monotonic())

    def write(self, records: list[StepRecord]) -> None:
        self.latest.update(records)
        self.pace.add_records(records)
        self.step_done(records[-1].step)
        self.live.update(self._render(), refresh=True)

    def close(self) -> None:
        self.live.stop()


def make_console_sink(
    mode: ConsoleMode, total_steps: int, tokens: bool, peak_memory: Callable[[], Optional[int]], scaled: bool = True
) -> Optional[object]:
    if mode is ConsoleMode.quiet:
        return None
    console = Console()
    live = mode is ConsoleMode.live or (mode is ConsoleMode.auto and console.is_terminal and sys.stdout.isatty())
    if live:
        return LiveConsole(total_steps, tokens, peak_memory, console, scaled)
    return PlainConsole(total_steps, tokens, peak_memory, scaled)
