"""The live view and the plain lines: the time left, the table on a narrow terminal, loss scales as powers
of two, and the progress count every step without a read from the device."""

from __future__ import annotations

import io as stdio
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ampctl import machine_load
from ampctl.engine.telemetry import StepRecord, Telemetry
from ampctl.runner.reporting.console import LIVE_COLUMNS, LiveConsole, Pace, PlainConsole, fit_columns, format_duration


class MachineAt:
    """machine_load.sample() as a machine where other processes keep `others` cores busy: each sample a second on,
    this process idle (so that a line's words never depend on what the test machine does meanwhile)."""

    def __init__(self, others: float) -> None:
        self.others, self.t = others, 0.0

    def __call__(self) -> machine_load.Sample:
        self.t += 1.0
        return machine_load.Sample(self.t, self.others * self.t, 0.0)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    monkeypatch.setattr(machine_load, "sample", MachineAt(0.0))


def record(step: int, ms: float = 100.0, scale: float = 65536.0, skipped: bool = False) -> StepRecord:
    return StepRecord(step=step, loss=2.345678, loss_scale=scale, skipped=skipped, skipped_total=int(skipped),
                      grad_norm=1.5, lr=3e-4, step_time_ms=ms, samples_per_s=1953125.0, tokens_per_s=None,
                      tflops=1.0, mfu=0.4567)


def test_the_time_left_is_the_steps_left_times_the_median_step_so_far_without_the_first():
    pace = Pace(total_steps=100)
    assert pace.remaining_s(0) is None  # nothing to estimate from yet: the view says '?'
    pace.add(1, 5000.0)  # the first step compiles: alone, it is the estimate
    assert pace.remaining_s(1) == 99 * 5.0
    for step, ms in zip(range(2, 7), (100.0, 300.0, 200.0, 100.0, 900.0)):
        pace.add(step, ms)
    assert pace.remaining_s(6) == 94 * 0.2  # median of 100, 300, 200, 100, 900; the 5 s first step left out
    pace.add_records([record(5, ms=1e6), record(6, ms=1e6)])  # already counted on the host: not twice
    assert pace.remaining_s(6) == 94 * 0.2
    pace.add_records([record(7, ms=200.0)])
    assert pace.remaining_s(7) == 93 * 0.2
    assert format_duration(3725.4) == "1:02:05" and format_duration(None) == "?"
    assert format_duration(2.0**62) == "1.46e+11 years"  # train.steps=2^63-1: past what a timedelta holds


def test_the_live_table_fits_80_columns_by_dropping_whole_columns_never_cutting_numbers(monkeypatch):
    # rich sizes a dumb terminal (TERM=dumb or unknown, as some CI shells set) at 80 whatever width it is given:
    # these consoles are the terminals they say they are, whatever the suite's own runs in
    monkeypatch.setenv("TERM", "xterm-256color")
    console = Console(file=stdio.StringIO(), width=80, force_terminal=True, color_system=None)
    cells = {"step": "123456", "loss": "2.3457", "loss scale": "2^16", "skipped": "12 (last 123400)",
             "throughput": "1953.1k samples/s", "step time": "123.4 ms", "grad norm": "1.5", "peak mem": "12.3 GiB",
             "lr": "0.0003", "MFU": "45.7%", "load": "1.42x"}
    console.print(fit_columns(cells, 80, console))
    lines = console.file.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in "".join(lines)
    header = lines[0].split()
    assert header[:3] == ["step", "loss", "loss"] and "MFU" not in header  # the least important went first
    for value in ("123456", "2.3457", "2^16", "12 (last 123400)", "1953.1k samples/s"):
        assert value in lines[1]
    wide = Console(file=stdio.StringIO(), width=200, force_terminal=True, color_system=None)
    wide.print(fit_columns(cells, 200, wide))
    assert all(name.split()[0] in wide.file.getvalue() for name in LIVE_COLUMNS)


def test_the_live_view_counts_every_step_and_shows_the_first_row_after_step_one():
    """Driven by a real Telemetry: step_done every step (the bar), a row after step 1 and on log steps."""
    out = stdio.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    live = LiveConsole(total_steps=10, tokens=False, peak_memory=lambda: 2**20, console=console)
    telemetry = Telemetry(torch.device("cpu"), log_every=4, samples_per_step=8, tokens_per_step=None, sinks=[live])
    one = torch.tensor(1.0)
    seen = []
    for step in range(1, 6):
        telemetry.record(step, one * 2, torch.tensor(32768.0), torch.tensor(0.0), one, torch.tensor(1e-3))
        telemetry.end_step(last=step == 10)
        seen.append((live.progress.tasks[0].completed, live.latest.record and live.latest.record.step))
    live.close()
    assert seen == [(1, 1), (2, 1), (3, 1), (4, 4), (5, 4)]  # the bar each step; rows after step 1 and step 4
    assert live.pace.remaining_s(5) is not None  # CPU steps are timed on the host: an ETA between log steps
    assert re.search(r"eta \d+:\d\d:\d\d", str(live.progress.columns[-1].render(live.progress.tasks[0])))
    text = out.getvalue()
    assert "2^15" in text and "eta" in text and "…" not in text


def test_plain_lines_carry_the_time_left_and_the_scale_as_a_power_of_two(capsys):
    plain = PlainConsole(total_steps=100, tokens=False, peak_memory=lambda: None)
    plain.write([record(1, ms=1000.0)])
    plain.write([record(step, ms=100.0) for step in range(2, 11)])
    lines = capsys.readouterr().out.splitlines()
    assert "scale 2^16" in lines[0] and lines[0].endswith("eta 0:01:39")  # 99 steps at the first step's 1 s
    assert re.search(r"step 10/100 .* eta 0:00:09$", lines[1])  # 90 steps at the median 100 ms


def test_a_mode_without_a_loss_scaler_shows_no_scale_and_no_skips(capsys):
    """bf16, nvfp4, fp32 have no scaler: their "scale 1" and "skipped 0" were no scale's and no skip's (the plain line,
    the live table, the done line); a mode with one shows both."""
    from ampctl.runner.recorder import final_line

    plain = PlainConsole(total_steps=100, tokens=False, peak_memory=lambda: None, scaled=False)
    plain.write([record(1)])
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("step 1/100 | loss ") and "scale" not in line and "skipped" not in line
    live = LiveConsole(total_steps=10, tokens=False, peak_memory=lambda: None, scaled=False,
                       console=Console(file=stdio.StringIO(), width=200, force_terminal=True, color_system=None))
    live.write([record(1)])
    live.close()
    assert "loss" in live._cells() and not {"loss scale", "skipped"} & set(live._cells())
    summary = {"steps": 4, "final_loss": 2.0, "skipped_total": 0, "final_loss_scale": 1.0, "median_step_time_ms": 1.0,
               "samples_per_s": 10.0}
    assert "scale" not in final_line({**summary, "scaler": "none"}, Path("run"))
    assert "skipped 0 | final scale 1 | " in final_line({**summary, "scaler": "static"}, Path("run"))


def test_a_log_interval_while_other_processes_took_the_machine_says_so_where_the_speed_is_shown(capsys, monkeypatch):
    """The busy test is the machine's (other processes' CPU time over wall time), not the run's own core share."""
    monkeypatch.setattr(machine_load, "sample", MachineAt(0.9 * machine_load.cores()))
    plain = PlainConsole(total_steps=10, tokens=False, peak_memory=lambda: None)
    plain.write([record(1)])
    line = capsys.readouterr().out.strip()
    cores = machine_load.cores()
    assert f"samples/s (busy: other processes used {0.9 * cores:.1f} of {cores} cores) |" in line, line
    monkeypatch.setattr(machine_load, "sample", MachineAt(0.01))
    plain = PlainConsole(total_steps=10, tokens=False, peak_memory=lambda: None)
    plain.write([record(1)])
    assert "busy" not in capsys.readouterr().out


def test_hydras_own_lines_break_at_words_on_a_terminal_and_stay_whole_off_one(monkeypatch):
    """conf/hydra/hydra_logging/terminal.yaml's formatter: a sweeper's line longer than the terminal broke mid-word
    (`optimizer` / `.lr=0.1`)."""
    import logging

    from ampctl.shell.library_logs import WordWrappingFormatter

    class Terminal(stdio.StringIO):
        def isatty(self) -> bool:
            return True

    record = logging.LogRecord("hydra", logging.INFO, __file__, 1, "#3 : recipe=mlp train.steps=20 "
                               "optimizer.lr=0.1 precision=fp16 scaler.init_scale=65536", None, None)
    formatter = WordWrappingFormatter("[HYDRA] %(message)s")
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr("sys.stdout", Terminal())
    lines = formatter.format(record).splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 40
    assert " ".join(line.strip() for line in lines) == f"[HYDRA] {record.getMessage()}"  # broken at spaces only
    monkeypatch.setattr("sys.stdout", stdio.StringIO())
    assert formatter.format(record) == f"[HYDRA] {record.getMessage()}"
