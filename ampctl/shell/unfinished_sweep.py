"""A sweep whose launcher ended in an exception of its own: a launcher that runs the jobs in processes of their own
(hydra/launcher=submitit_local, submitit_slurm, ray) raises KeyboardInterrupt when Ctrl-C ends its wait, or its
own error for a job the batch system killed (submitit's UncompletedJobError). The jobs' records are on disk: the
sweep's table is written from them, and one line says how the sweep ended and what continues it."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from ampctl.conf import sweeps
from ampctl.conf.sweeps import SweepIdentity
from ampctl.interrupt import exit_at_once_on_another_signal, interrupt_behind, signal_name
from ampctl.reports.runs import holder_pid
from ampctl.shell.outcomes import leave
from ampctl.shell.this_process import THIS_PROCESS

# How long the launcher waits for its jobs to stop (each, stopped by the same Ctrl-C or by the launcher, finishes
# its step and writes its checkpoint): a batch system's jobs that go on running are shown as running after it
STOPPING_JOBS_WAIT_S = 30.0


def _wait_for_stopping_jobs(sweep_dir: Path) -> None:
    def running() -> list[Path]:
        return [job for job in sweep_dir.iterdir() if job.is_dir() and holder_pid(job) is not None]

    deadline = time.monotonic() + STOPPING_JOBS_WAIT_S
    if running():
        print("ampctl sweep: waiting for the running jobs to stop and write their checkpoints", file=sys.stderr,
              flush=True)
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)


def report_the_unfinished_sweep(command: str, exc: BaseException) -> None:
    """If this process launched a sweep that exc ended before its end: its table from what is on disk, and one line
    saying how it ended and what continues it; then the command leaves as the outcome table says."""
    sweep_dir = THIS_PROCESS.end_the_sweep()
    if sweep_dir is None:
        return
    from ampctl.reports.sweep import write_sweep_report  # its tables and plots: only once a sweep needs them

    interrupt = interrupt_behind(exc)
    if interrupt is not None:  # another Ctrl-C while the jobs stop and the table is written: exit at once
        exit_at_once_on_another_signal(getattr(interrupt, "signum", signal.SIGINT))
    how = (f"interrupted ({signal_name(interrupt)}) while its launcher waited for the jobs" if interrupt is not None
           else f"ended: its launcher failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
    identity = SweepIdentity.recorded(sweep_dir)
    if interrupt is not None:  # jobs its signal does not reach (a Ray worker, a SLURM node) stop on this request
        sweeps.request_stop(sweep_dir, signal_name(interrupt))
    if sweep_dir.is_dir():
        _wait_for_stopping_jobs(sweep_dir)
        write_sweep_report(sweep_dir, says_how_to_continue=False)  # the line below says it
    then = f"; continue it with: {identity.command(sweep_dir)}" if identity is not None else ""
    leave(interrupt or exc, [f"ampctl {command}: sweep {how}{then}"])
