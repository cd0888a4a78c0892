"""Each command's check of one job's config: what the job would refuse, refused before any job starts.

Hydra composes and runs; ampctl only listens, through Hydra's public API. A Callback checks a single run
before Hydra creates its directory; when a multirun starts, the same Callback composes each
job's config with `hydra.compose` (the app's own search path, `-cd` and `-cn` included) and runs the
command's check on it, so that a bad value in the tenth job of a sweep is one line before the first job
trains. Under a sweeper plugin that chooses its jobs as it goes (Optuna), the base config is checked up
front and each job again when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ampctl.conf.composing import compose_job, without_hydra_node
from ampctl.conf.messages import one_line
from ampctl.conf.schema import APP_SCHEMAS, ParallelKind, validate
from ampctl.conf.sweeps import SWEEP_RECORD, SweepIdentity, base_overrides, planned_jobs, sweep_overrides
from ampctl.conf.typed import typed_config
from ampctl.errors import CommandLineRefused, UsageError
from ampctl.processes import is_main_process, start_is_over, torchrun_world_size

if TYPE_CHECKING:
    from ampctl.runner.plan import RunPlan


def refuse_distributed(cfg: DictConfig, command: str) -> None:
    if cfg.distributed.kind is not ParallelKind.none:
        raise UsageError(f"distributed={cfg.distributed.kind.value}: ampctl {command} runs on one device; "
                         f"data parallelism is for ampctl train under torchrun")


def check_train(cfg: DictConfig) -> None:
    """A sweep's job, checked before the first starts (each is planned again as it starts: runner/plan.py)."""
    from ampctl.runner.plan import check_config
    from ampctl.runner.trackers import check_loggers

    check_config(cfg)
    check_loggers(cfg.logger)


def check_compare(cfg: DictConfig) -> None:
    from ampctl.runner.trackers import check_loggers

    validate(cfg)  # each mode is composed and checked against the device when the comparison is planned
    refuse_distributed(cfg, "compare")
    check_loggers(cfg.logger)


def check_memory(cfg: DictConfig) -> None:
    from ampctl.analysis.memory.model import parse_size

    validate(cfg)
    refuse_distributed(cfg, "memory")
    if cfg.memory.budget is not None:
        parse_size(cfg.memory.budget)


def check_inspect(cfg: DictConfig) -> None:
    from ampctl.analysis.ranges import power_of_two_log2

    validate(cfg)
    refuse_distributed(cfg, "inspect")
    if cfg.inspect.loss_scale is not None:
        power_of_two_log2(cfg.inspect.loss_scale, "inspect.loss_scale")


def check_advise(cfg: DictConfig) -> None:
    validate(cfg)  # its studies check each mode and run as they go
    refuse_distributed(cfg, "advise")


# command -> its check (its primary config's schema: conf.schema.APP_SCHEMAS)
CHECKS = {"train": check_train, "compare": check_compare, "memory": check_memory, "inspect": check_inspect,
          "advise": check_advise}


def typed(command: str, cfg: DictConfig) -> DictConfig:
    """cfg typed by `command`'s schema (a key it lacks, a value of the wrong type: UsageError)."""
    try:
        return typed_config(cfg, APP_SCHEMAS[command][1])
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None


def refuse_numbers_for_booleans(cfg: DictConfig, overrides: list[str]) -> None:
    """`telemetry.profile_cpu_memory=2`: OmegaConf takes any integer for a boolean (2 is true); a number where
    true or false is expected is a mistake, refused naming the key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import BooleanNode

    from ampctl.errors import ConfigError

    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete() or override.is_sweep_override() or "/" in override.key_or_group:
            continue
        value = override.value()
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        node: Any = cfg
        for part in override.key_or_group.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if isinstance(node, BooleanNode):
            raise ConfigError(override.key_or_group, value, "true or false")


def check_command(command: str, cfg: DictConfig) -> DictConfig:
    """cfg typed by `command`'s schema and checked; raises UsageError. Returns the typed config."""
    cfg = typed(command, cfg)
    CHECKS[command](cfg)
    return cfg


def task_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The command line's overrides as typed: `train.steps=${x}` is text here, not an interpolation to resolve."""
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]  # type: ignore[union-attr]


def main_run_dir(hydra_cfg: DictConfig) -> Path:
    """Rank 0's run directory, on any rank. The other ranks run with hydra.run.dir=. (they write nothing of
    their own); they read the run dir the command line gave, which names the same directory on every rank
    when resume=auto has one to continue (a timestamped default is a new directory on every rank). A job
    that runs has its own directory (a sweep's job: under the sweep's); a run being checked, the one planned."""
    if is_main_process():
        job_dir = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None, throw_on_missing=False)
        return Path(job_dir or hydra_cfg.run.dir)
    given = [o.split("=", 1)[1] for o in hydra_cfg.overrides.hydra if o.startswith("hydra.run.dir=")]
    return Path(given[-2] if len(given) > 1 else ".")


@dataclass
class Job:
    """A study command's job as it will run, once checked: its config and its group choices. (A training run's
    is a RunPlan, runner/plan.py, which holds both too.)"""

    cfg: DictConfig
    choices: dict[str, str]


def train_run(cfg: DictConfig, hydra_cfg: DictConfig) -> "RunPlan":
    """`ampctl train`'s run, planned: a resumed run's own config and choices, with the changes the command line
    names, its checkpoint, its policy and trackers checked (runner/plan.py); UsageError for what it refuses."""
    from ampctl.runner.plan import plan_run

    run_dir = main_run_dir(hydra_cfg)
    cfg = continuing_a_requeued_job(cfg, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg = continuing_a_jobs_earlier_attempt(cfg, run_dir, hydra_cfg.job.num)
    return plan_run(cfg, run_dir, dict(hydra_cfg.runtime.choices), task_overrides(hydra_cfg), torchrun_world_size())


def _resumed(cfg: DictConfig) -> DictConfig:
    continued = cfg.copy()
    continued.resume = "auto"
    return continued


def continuing_a_requeued_job(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """cfg, with resume=auto when this process is the batch job that started the run in run_dir, requeued by its
    engine (which runs the job's original overrides again): it continues its own run, as it was stopped to do."""
    from ampctl.runner.identity import requeued_here

    if cfg.resume:
        return cfg
    own = requeued_here(run_dir, cfg)  # every rank reads the run's identity (storage every node shares)
    if own is None:
        return cfg
    if is_main_process():
        print(f"ampctl train: batch job {own.job} was requeued: it continues its run in {run_dir}", flush=True)
    return _resumed(cfg)


def continuing_a_jobs_earlier_attempt(cfg: DictConfig, run_dir: Path, num: int) -> DictConfig:
    """A sweep's job whose directory holds a run already: the same job started again by the engine that runs it
    (Ray retries a task whose worker died; a batch system requeues a job) with its original overrides. The sweep's
    directory was checked to be this sweep's before its first job, and each job has a directory of its own, so a
    run there with this job's config is this job's earlier attempt: it continues (it trained again from step 0 over
    the earlier attempt's records, every step twice in metrics.jsonl). One with another config is refused."""
    from ampctl.runner import identity

    if cfg.resume:
        return cfg
    earlier = identity.read(run_dir)
    if earlier is None:
        return cfg
    if identity.config_hash(identity.resolved(cfg)) != earlier.config_hash:
        raise UsageError(f"{run_dir} holds a run with another config than job #{num}'s (run {earlier.run_id[:8]}): "
                         "a sweep's job continues only its own earlier attempt")
    if is_main_process():
        print(f"ampctl train: job #{num} started again (its engine retried it): it continues its earlier attempt "
              f"in {run_dir}", flush=True)
    return _resumed(cfg)


def check_single_run(command: str, config: DictConfig) -> "Job | RunPlan":
    """A single run's check (its config with the hydra node, as Hydra or the Python API composed it), before
    anything is written: its values, and that its output directory is its own. Returns the job as it will run
    (for train, its plan: a resumed run's own config, its checkpoint, its policy). UsageError when refused."""
    from ampctl.runner.ownership import refuse_another_commands_directory, refuse_another_runs_directory

    cfg = typed(command, without_hydra_node(config))
    refuse_numbers_for_booleans(cfg, task_overrides(config.hydra))
    if command == "train":
        if is_main_process():  # the other ranks record nothing (run.dir=.)
            from ampctl.runner.identity import requeued_here

            requeued = not cfg.resume and requeued_here(Path(config.hydra.run.dir), cfg) is not None
            refuse_another_runs_directory(config.hydra.run.dir, "auto" if requeued else cfg.resume)
        return train_run(cfg, config.hydra)  # a refused resume, refused before Hydra writes
    refuse_another_commands_directory(command, config.hydra.run.dir)
    job = Job(cfg, dict(config.hydra.runtime.choices))
    CHECKS[command](job.cfg)
    return job


@dataclass
class PlannedRun:
    """The single run Hydra is about to start, as its check left it."""

    run_dir: Path
    job: "Job | RunPlan"


# Set once a single run passed its check: the task function takes its job from here instead of resolving a
# resume again, and a Ctrl-C in the moment between Hydra making the run directory and the task function
# starting leaves only that directory behind (cli.py removes it).
planned: Optional[PlannedRun] = None


def job_of(command: str, cfg: DictConfig, hydra_cfg: DictConfig) -> "Job | RunPlan":
    """In a command's task function: the job its check planned for this run, or, for a sweep's job (checked
    with the others before the first started), the job as this one runs it."""
    global planned
    found, planned = planned, None
    if found is not None and found.run_dir.resolve() == Path(hydra_cfg.runtime.output_dir).resolve():
        return found.job
    if command == "train":
        return train_run(typed("train", cfg), hydra_cfg)
    return Job(check_command(command, cfg), dict(hydra_cfg.runtime.choices))


class CheckEveryJob(Callback):
    """Runs `command`'s check on every job of a multirun before the first job starts (see the module doc).
    A refusal leaves Hydra as CommandLineRefused; the router prints it as one line, exit code 2."""

    def __init__(self, command: str) -> None:
        self.command = command

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # before Hydra creates the run directory: a refused run leaves nothing behind, and touches no other run
        try:
            job = check_single_run(self.command, config)
        except UsageError as exc:
            raise CommandLineRefused(exc) from None
        global planned
        planned = PlannedRun(Path(config.hydra.run.dir), job)
        start_is_over()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = planned_jobs(config) or [base_overrides(sweep_overrides(config))]
        try:
            for job in jobs:
                cfg = check_command(self.command, compose_job(config.hydra.job.config_name, job))
                refuse_numbers_for_booleans(cfg, job)
            from ampctl.runner.ownership import refuse_another_sweeps_directory

            refuse_another_sweeps_directory(config.hydra.sweep.dir, cfg.get("resume"), SweepIdentity.of(config))
        except UsageError as exc:
            raise CommandLineRefused(exc) from None
        start_is_over()


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
