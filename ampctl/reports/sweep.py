"""Hydra callback for `ampctl train -m`: which job of how many is running with an overall ETA, and at the
end one table of all jobs (swept keys, final loss, skipped steps, final scale, throughput), written to the
multirun directory with its plots. Failed jobs are listed with their error; they do not hide the others."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.conf.sweeps import SweepIdentity, planned_jobs
from ampctl.reports import tables
from ampctl.reports.runs import find_runs


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


# The sweep this process launched, while it runs. A launcher that runs the jobs in processes of their own
# (hydra/launcher=submitit_local, submitit_slurm, ray) can end in an exception of its own: Ctrl-C while it waits,
# a job the batch system killed (submitit's UncompletedJobError). The table of what the jobs recorded is then
# still written, by report_the_unfinished_sweep (cli.py).
running: Optional[Path] = None


def report_the_unfinished_sweep(command: str, exc: BaseException) -> None:
    """If this process launched a sweep that exc ended before its end: its table from what is on disk, and one line
    saying how it ended and what continues it; then the command leaves as the outcome table says."""
    from ampctl.commands.outcomes import leave
    from ampctl.interrupt import exit_at_once_on_another_signal, interrupt_behind, signal_name

    global running
    sweep_dir, running = running, None
    if sweep_dir is None:
        return
    interrupt = interrupt_behind(exc)
    if interrupt is not None:  # another Ctrl-C while the jobs stop and the table is written: exit at once
        exit_at_once_on_another_signal(getattr(interrupt, "signum", signal.SIGINT))
    how = (f"interrupted ({signal_name(interrupt)}) while its launcher waited for the jobs" if interrupt is not None
           else f"ended: its launcher failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
    identity = SweepIdentity.recorded(sweep_dir)
    if sweep_dir.is_dir():
        _wait_for_stopping_jobs(sweep_dir)
        write_sweep_report(sweep_dir)
    then = f"; continue it with: {identity.command(sweep_dir)}" if identity is not None else ""
    leave(interrupt or exc, [f"ampctl {command}: sweep {how}{then}"])


# How long the launcher waits for its jobs to stop (each, stopped by the same Ctrl-C or by the launcher, finishes
# its step and writes its checkpoint): a batch system's jobs that go on running are shown as running after it
STOPPING_JOBS_WAIT_S = 30.0


def _wait_for_stopping_jobs(sweep_dir: Path) -> None:
    from ampctl.reports.runs import holder_pid

    def running() -> list[Path]:
        return [job for job in sweep_dir.iterdir() if job.is_dir() and holder_pid(job) is not None]

    deadline = time.monotonic() + STOPPING_JOBS_WAIT_S
    if running():
        print("ampctl sweep: waiting for the running jobs to stop and write their checkpoints", file=sys.stderr,
              flush=True)
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)


class SweepReport(Callback):
    def __init__(self) -> None:
        self.total_jobs = 0
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "optuna" in sys.modules:  # the Optuna sweeper's library: its own INFO lines ("A new study created")
            sys.modules["optuna"].logging.set_verbosity(sys.modules["optuna"].logging.WARNING)
        jobs = planned_jobs(config)  # None when a sweeper plugin chooses the jobs: its trial count, if it says
        trials = OmegaConf.select(config, "hydra.sweeper.n_trials")
        self.total_jobs = len(jobs) if jobs is not None else int(trials or 0)
        self.started = time.perf_counter()
        global running
        sweep_dir = running = Path(str(config.hydra.sweep.dir))
        how_many = io.count_of(self.total_jobs, "job") if self.total_jobs else "its jobs"
        print(f"ampctl sweep: {how_many} in {sweep_dir}; if it stops, continue it with: "
              f"{SweepIdentity.of(config).command(sweep_dir)}", flush=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not self.total_jobs:
            return
        num = config.hydra.job.num  # 0-based
        elapsed = time.perf_counter() - self.started
        eta = f"eta {format_seconds(elapsed / num * (self.total_jobs - num))}" if num else "eta -"
        overrides = " ".join(io.readable_override(str(o)) for o in
                             OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
        # #N as Hydra's launcher and the job's directory (N_<overrides>) number it, of how many
        print(f"ampctl sweep: job #{num} ({num + 1} of {self.total_jobs}: {overrides}) | elapsed "
              f"{format_seconds(elapsed)} | {eta}", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global running
        running = None
        failed = write_sweep_report(Path(config.hydra.sweep.dir))
        if failed:
            sys.exit(1)  # the table says which jobs failed and why; the exit code says that some did


def write_sweep_report(sweep_dir: Path, console=None) -> int:
    """Table, sweep.csv, sweep.json, report.md and plots for a multirun directory. Returns the failed count."""
    runs = find_runs(sweep_dir)
    identity = SweepIdentity.recorded(sweep_dir)
    table = tables.sweep_table(runs, identity.command(sweep_dir) if identity is not None else None)
    console = console or tables.make_console()
    tables.print_table(table, console)  # first: a directory that cannot be written still shows its report
    keys = tables.swept_keys(runs)
    labels = [(f"#{run.job}: " + " ".join(io.readable_override(f"{k}={run.override_values().get(k)}") for k in keys),
               run) for run in runs]
    images = tables.run_images([(label, run) for label, run in labels if not run.failed], sweep_dir)
    machine = tables.machine_info([run.summary for run in runs if run.summary])
    tables.write_files(table, sweep_dir, "sweep", machine, images, {"kind": "multirun"})
    console.print(f"wrote sweep.csv, sweep.json, report.md and plots in {sweep_dir}")
    return sum(run.failed for run in runs)
