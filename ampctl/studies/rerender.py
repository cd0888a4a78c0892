"""What `ampctl report PATH` renders, by the kind of directory: a run, a multirun, or a study's JSON record (each
study command's record and rerender, from its COMMAND: shell/command.rerenderable); commands/report.py is its
command line."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Optional

from rich.console import Console

from ampctl import run_files
from ampctl.conf.sweeps import SWEEP_RECORD
from ampctl.errors import UsageError
from ampctl.reports import tables
from ampctl.reports.runs import find_runs, is_run_dir, load_run, row_problems
from ampctl.reports.sweep import write_sweep_report

# a study's record file -> how its directory is rendered again: (the directory, a console) -> its failed runs
Rerenders = Mapping[str, Callable[[Path, Console], Optional[int]]]


def render(path: Path, records: Rerenders, reportable: str) -> int:
    """Render the report for path; returns the number of failed runs in it. records: the studies' (each study
    command's record and its rerender); reportable: what PATH may be, in words. Raises UsageError."""
    if not path.exists():
        raise UsageError(f"PATH={str(path)!r} does not exist; give {reportable}")
    if not path.is_dir():
        raise UsageError(f"PATH={str(path)!r} is a file; give {reportable}")
    console = tables.make_console()
    for record, rerender in records.items():  # advise's first: its directory holds the other studies' in their own
        if (path / record).is_file():
            try:
                return rerender(path, console) or 0
            except (ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
                raise UsageError(f"{path / record} is not a whole ampctl record ({type(exc).__name__}: {exc}); "
                                 "run the command that wrote it again") from None
    if is_run_dir(path):
        run = load_run(path)
        for problem in row_problems(run.metrics):
            console.print(f"warning: {path / run_files.METRICS}: {problem}")
        if run.unfinished:
            _render_unfinished(run, console)
            return 0
        table = tables.single_run_table(run)
        also = [t] if (t := tables.escalations_table(run)) is not None else []
        for shown in (table, *also):  # first: a directory that cannot be written still shows its report
            tables.print_table(shown, console)
        images = tables.run_images([(run.name, run)], path)
        machine = tables.machine_info([run.summary] if run.summary else [])
        files = tables.write_files(table, path, "run", machine, images, {"kind": "run"}, also)
        console.print(tables.wrote([*files, *images], path))
        return int(run.failed)
    if (path / SWEEP_RECORD).is_file():
        return write_sweep_report(path, console)
    if find_runs(path):  # runs of ampctl's in a directory it did not make (outputs/, a folder of the user's)
        return write_sweep_report(path, console, writes=False)
    raise UsageError(f"PATH={str(path)!r} holds no ampctl runs (no summary.json or metrics.jsonl, no multirun.yaml, "
                     f"no {', '.join(records)})")


def _render_unfinished(run, console) -> None:
    """A running or interrupted run: where it is, from its rows; nothing written into its directory (a
    report of a part would be taken for the run's, and the run itself may still be writing)."""
    if run.metrics:
        last = run.metrics[-1]
        keys = ("step", "loss", "loss_scale", "skipped_total", "lr")
        tables.print_table(tables.ReportTable(f"run {run.path} (last row)", ["key", "value"],
                                              [[k, last[k]] for k in keys if k in last]), console)
    console.print(f"{run.unfinished}; no report written (it is written from the finished run's summary)")
