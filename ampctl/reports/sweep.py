"""A sweep's report: one table of all jobs (swept keys, final loss, skipped steps, final scale, throughput),
written to the multirun directory with its plots (shell/sweep_callbacks.py writes it at the sweep's end; `ampctl
report` again). Failed jobs are listed with their error; they do not hide the others."""

from __future__ import annotations

from pathlib import Path

from ampctl import io
from ampctl.conf.sweeps import SWEEP_RECORD, SweepIdentity
from ampctl.reports import tables
from ampctl.reports.runs import find_runs


def plot_label(job: str, swept: dict) -> str:
    """A job's line in the sweep's plots: its number and the values swept (none in a sweep of one job)."""
    values = " ".join(io.readable_override(f"{key}={value}") for key, value in swept.items())
    return f"#{job}: {values}" if values else f"#{job}"


def write_sweep_report(sweep_dir: Path, console=None, says_how_to_continue: bool = True, writes: bool = True) -> int:
    """Table, sweep.csv, sweep.json, report.md and plots for a multirun directory. Returns the failed count.
    says_how_to_continue=False: the caller's own last line says it (the table would print the command twice).
    writes=False: the table only (a directory ampctl did not make as a sweep: its files are not ampctl's to replace)."""
    runs = find_runs(sweep_dir)
    identity = SweepIdentity.recorded(sweep_dir)
    table = tables.sweep_table(runs, identity.command(sweep_dir) if identity is not None else None,
                               note_it=says_how_to_continue)
    console = console or tables.make_console()
    tables.print_table(table, console)  # first: a directory that cannot be written still shows its report
    if not writes:
        tables.print_line(console, f"nothing written in {sweep_dir}: it holds runs but is no multirun directory (no "
                                   f"{SWEEP_RECORD}), and its report.md or plots would not be ampctl's to replace")
        return sum(run.failed for run in runs)
    keys = tables.swept_keys(runs)
    labels = [(plot_label(run.job, {k: run.override_values().get(k) for k in keys}), run) for run in runs]
    images = tables.run_images([(label, run) for label, run in labels if not run.failed], sweep_dir)
    machine = tables.machine_info([run.summary for run in runs if run.summary])
    files = tables.write_files(table, sweep_dir, "sweep", machine, images, {"kind": "multirun"})
    console.print(tables.wrote([*files, *images], sweep_dir))
    return sum(run.failed for run in runs)
