"""Hydra callback for `ampctl train -m`: which job of how many is running with an overall ETA, and at the end the
sweep's table (reports/sweep.py); the exit code says whether some jobs failed (shell/outcomes.py)."""

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
from ampctl.interrupt import keep_ctrl_c_from_the_launchers_processes
from ampctl.reports.sweep import write_sweep_report
from ampctl.reports.sweep_progress import IN_PROCESS_LAUNCHERS, format_seconds, watch
from ampctl.shell.this_process import THIS_PROCESS, RunningSweep

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
        sweep = THIS_PROCESS.sweep = RunningSweep(Path(str(config.hydra.sweep.dir)))
        sweep_dir = sweep.sweep_dir
        sweeps.clear_stop_request(sweep_dir)  # an earlier attempt's, which stopped it: this one goes on
        how_many = io.count_of(self.total_jobs, "job") if self.total_jobs else "its jobs"
        print(io.for_the_terminal(f"ampctl sweep: {how_many} in {sweep_dir}; if it stops, continue it with: "
                                  f"{SweepIdentity.of(config).command(sweep_dir)}"), flush=True)
        launcher = OmegaConf.select(config, "hydra.launcher._target_")
        if launcher not in IN_PROCESS_LAUNCHERS:
            sweep.watcher = watch(sweep_dir, self.total_jobs, self.started)  # its jobs' lines are in their logs
        if launcher in CONTROLLED_LAUNCHERS:  # after the watcher's thread starts: it takes the Ctrl-C
            sweep.mask_before = keep_ctrl_c_from_the_launchers_processes()

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
        THIS_PROCESS.end_the_sweep()
        failed = write_sweep_report(Path(config.hydra.sweep.dir))
        if failed:
            raise SomeRunsFailed(failed)  # the table says which jobs failed and why; the exit code that some did
