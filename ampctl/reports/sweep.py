"""Hydra callback for `ampctl train -m`: which job of how many is running with an overall ETA, and at the
end one table of all jobs (swept keys, final loss, skipped steps, final scale, throughput), written to the
multirun directory with its plots. Failed jobs are listed with their error; they do not hide the others."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.conf import sweeps
from ampctl.conf.sweeps import SweepIdentity, planned_jobs
from ampctl.errors import SomeRunsFailed
from ampctl.interrupt import give_ctrl_c_back, keep_ctrl_c_from_the_launchers_processes
from ampctl.reports import tables
from ampctl.reports.runs import find_runs
from ampctl.reports.sweep_progress import IN_PROCESS_LAUNCHERS, format_seconds, stop_watching, watch

# launchers whose per-job controller process kills its job a second after a Ctrl-C reaches it (submitit's local one)
CONTROLLED_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",)


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
        sweep_dir = sweeps.running = Path(str(config.hydra.sweep.dir))
        sweeps.clear_stop_request(sweep_dir)  # an earlier attempt's, which stopped it: this one goes on
        how_many = io.count_of(self.total_jobs, "job") if self.total_jobs else "its jobs"
        print(io.for_the_terminal(f"ampctl sweep: {how_many} in {sweep_dir}; if it stops, continue it with: "
                                  f"{SweepIdentity.of(config).command(sweep_dir)}"), flush=True)
        launcher = OmegaConf.select(config, "hydra.launcher._target_")
        if launcher not in IN_PROCESS_LAUNCHERS:
            watch(sweep_dir, self.total_jobs, self.started)  # its jobs' progress lines are in their own logs
        if launcher in CONTROLLED_LAUNCHERS:  # after the watcher's thread starts: it takes the Ctrl-C
            keep_ctrl_c_from_the_launchers_processes()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not self.total_jobs:
            return
        num = config.hydra.job.num  # 0-based
        elapsed = time.perf_counter() - self.started
        eta = f"eta {format_seconds(elapsed / num * (self.total_jobs - num))}" if num else "eta -"
        overrides = " ".join(io.readable_override(str(o)) for o in
                             OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
        # #N as Hydra's launcher and the job's directory (N_<overrides>) number it, of how many
        print(io.for_the_terminal(f"ampctl sweep: job #{num} ({num + 1} of {self.total_jobs}: {overrides}) | "
                                  f"elapsed {format_seconds(elapsed)} | {eta}"), flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        give_ctrl_c_back()
        stop_watching()
        sweeps.running = None
        failed = write_sweep_report(Path(config.hydra.sweep.dir))
        if failed:
            raise SomeRunsFailed(failed)  # the table says which jobs failed and why; the exit code that some did


def plot_label(job: str, swept: dict) -> str:
    """A job's line in the sweep's plots: its number and the values swept (none in a sweep of one job)."""
    values = " ".join(io.readable_override(f"{key}={value}") for key, value in swept.items())
    return f"#{job}: {values}" if values else f"#{job}"


def write_sweep_report(sweep_dir: Path, console=None, says_how_to_continue: bool = True) -> int:
    """Table, sweep.csv, sweep.json, report.md and plots for a multirun directory. Returns the failed count.
    says_how_to_continue=False: the caller's own last line says it (the table would print the command twice)."""
    runs = find_runs(sweep_dir)
    identity = SweepIdentity.recorded(sweep_dir)
    table = tables.sweep_table(runs, identity.command(sweep_dir) if identity is not None else None,
                               note_it=says_how_to_continue)
    console = console or tables.make_console()
    tables.print_table(table, console)  # first: a directory that cannot be written still shows its report
    keys = tables.swept_keys(runs)
    labels = [(plot_label(run.job, {k: run.override_values().get(k) for k in keys}), run) for run in runs]
    images = tables.run_images([(label, run) for label, run in labels if not run.failed], sweep_dir)
    machine = tables.machine_info([run.summary for run in runs if run.summary])
    files = tables.write_files(table, sweep_dir, "sweep", machine, images, {"kind": "multirun"})
    console.print(tables.wrote([*files, *images], sweep_dir))
    return sum(run.failed for run in runs)
