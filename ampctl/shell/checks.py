"""Each command's check of one job's config: what the job would refuse, refused before any job starts.

Hydra composes and runs; ampctl only listens, through Hydra's public API. A Callback checks a single run
before Hydra creates its directory; when a multirun starts, the same Callback composes each
job's config with `hydra.compose` (the app's own search path, `-cd` and `-cn` included) and runs the
command's check on it, so that a bad value in the tenth job of a sweep is one line before the first job
trains. Under a sweeper plugin that chooses its jobs as it goes (Optuna), the base config is checked up
front and each job again when it starts. A single run's check plans it (shell/plans.py), and the plan reaches its
task function through THIS_PROCESS (shell/this_process.py), the one object Hydra leaves for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ampctl.conf import precision_schedule
from ampctl.conf.composing import compose_job
from ampctl.conf.config_dirs import make_importable, user_config_dirs
from ampctl.conf.schema import ParallelKind, validate
from ampctl.conf.sweeps import SWEEP_RECORD, SweepIdentity, base_overrides, planned_jobs, sweep_overrides
from ampctl.errors import CommandLineRefused, UsageError
from ampctl.shell.plans import check_command, plan_a_single_run, refuse_numbers_for_booleans, task_overrides
from ampctl.shell.this_process import THIS_PROCESS


def one_device_only(cfg: DictConfig, command: str) -> None:
    """A study runs on one device: data parallelism is train's, under torchrun."""
    if cfg.distributed.kind is not ParallelKind.none:
        raise UsageError(f"distributed={cfg.distributed.kind.value}: ampctl {command} runs on one device; "
                         f"data parallelism is for ampctl train under torchrun")


# what an option of each group is called in a refusal
OPTION_OF = {"precision": "a precision mode", "optimizer": "an optimizer"}


def options_of_their_groups(key: str, names: Optional[Sequence[str]], group: str) -> None:
    """compare.precisions=[fp32,fp99]: each name an option of its config group, as the app's own search path (-cd's
    configs too) has them."""
    from hydra.core.global_hydra import GlobalHydra

    from ampctl.conf.messages import did_you_mean

    if names is None:
        return
    options = GlobalHydra.instance().config_loader().get_group_options(group)
    if group == "precision":  # a scheduled row names its modes: nvfp4_recipe->bf16@0.82
        names = [mode for name in names for mode in precision_schedule.modes_in(name)]
    for name in names:
        if name not in options:
            raise UsageError(f"{key}: {name!r} is not {OPTION_OF[group]}{did_you_mean(name, options)}; choose from "
                             f"{', '.join(options)}")


def validate_with_loggers(cfg: DictConfig) -> None:
    """The schema's checks, and the trackers' (logger=...): a command whose runs record to them."""
    from ampctl.runner.trackers import check_loggers

    validate(cfg)
    check_loggers(cfg.logger)


class CheckEveryJob(Callback):
    """Runs `command`'s check on every job of a multirun before the first job starts (see the module doc).
    A refusal leaves Hydra as CommandLineRefused; the router prints it as one line, exit code 2."""

    def __init__(self, command: str) -> None:
        self.command = command

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # before Hydra creates the run directory: a refused run leaves nothing behind, and touches no other run
        try:
            THIS_PROCESS.plan = plan_a_single_run(self.command, config)
        except UsageError as exc:
            raise CommandLineRefused(exc) from None
        THIS_PROCESS.plan_dir = Path(config.hydra.run.dir)
        THIS_PROCESS.keep_earlier_hydra_files(THIS_PROCESS.plan_dir)  # before Hydra writes over them
        THIS_PROCESS.end_the_start()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = planned_jobs(config) or [base_overrides(sweep_overrides(config))]
        make_importable(user_config_dirs(config.hydra))  # a written config's hydra.searchpath: its user's recipe
        try:
            for job in jobs:
                cfg = check_command(self.command, compose_job(config.hydra.job.config_name, job))
                refuse_numbers_for_booleans(cfg, job)
            from ampctl.runner.ownership import refuse_another_sweeps_directory

            refuse_another_sweeps_directory(config.hydra.sweep.dir, cfg.get("resume"), SweepIdentity.of(config))
        except UsageError as exc:
            raise CommandLineRefused(exc) from None
        THIS_PROCESS.end_the_start()


class KeepEarlierJobsHydraFiles(Callback):
    """A sweep resumed with resume=auto: Hydra writes the sweep's multirun.yaml when it launches, and every job's
    .hydra/ files before the job starts, over those of the earlier attempt (a finished job's record would then say
    resume=auto). They are read when the sweep starts and put back: the sweep's record as its first job starts, a
    job's as it starts (a kept job is untouched; a continued one records its resumed config itself,
    runner/recorder.py)."""

    def __init__(self) -> None:
        self.earlier: dict[Path, dict[str, bytes]] = {}
        self.sweep_record: Optional[tuple[Path, bytes]] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if "resume=auto" not in task_overrides(config.hydra) or not sweep_dir.is_dir():
            return
        if (sweep_dir / SWEEP_RECORD).is_file():
            self.sweep_record = (sweep_dir / SWEEP_RECORD, (sweep_dir / SWEEP_RECORD).read_bytes())
        for hydra_dir in sweep_dir.glob("*/.hydra"):
            self.earlier[hydra_dir.parent.resolve()] = {p.name: p.read_bytes() for p in hydra_dir.iterdir()
                                                        if p.is_file()}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ampctl import io

        if self.sweep_record is not None:
            io.atomic_write_bytes(*self.sweep_record)
            self.sweep_record = None
        job_dir = Path(config.hydra.runtime.output_dir).resolve()
        for name, data in self.earlier.get(job_dir, {}).items():
            io.atomic_write_bytes(job_dir / ".hydra" / name, data)
