"""`ampctl train [overrides]`: train a recipe under a precision mode. One Hydra app, so -m, --cfg, --help, -cd and run
dirs all work; ampctl.train() from Python."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ampctl import io, run_files
from ampctl.conf.schema import AmpctlConfig
from ampctl.conf.sweeps import SweepIdentity
from ampctl.errors import NothingToDo, RecipeFailed, RunStopped, UsageError
from ampctl.interrupt import Interrupted, hand_over, host_of, interrupt_behind, signal_name
from ampctl.processes import is_main_process, torchrun_world_size
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.ownership import holding, remove_if_only_hydra_files
from ampctl.shell.command import Command, Section
from ampctl.shell.outcomes import ENDINGS, Outcome, leave, outcome_of, write_refused_line
from ampctl.shell.plans import main_run_dir, plan_of, task_overrides
from ampctl.shell.python_api import PathLike, Result, planned_run

if TYPE_CHECKING:
    from ampctl.runner.plan import RunPlan

log = logging.getLogger(__name__)


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="train")
def train(cfg: DictConfig) -> Optional[float]:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # The run's directory is held until the command has said its last line (released as SystemExit leaves): a
    # launcher that waits for its stopping jobs' locks (shell/unfinished_sweep.py) and then ends their workers
    # (Ray's shutdown) finds each job's stop line in its train.log
    with contextlib.ExitStack() as held:
        try:
            run = plan_of("train", cfg, hydra_cfg)
            cfg = run.cfg
            if multirun and cfg.resume == "auto":
                kept = finished_job(run_dir, cfg.train.steps)
                if kept is not None:
                    steps = io.count_of(cfg.train.steps, "step")
                    print(f"ampctl train: job in {run_dir} finished earlier ({steps}): kept as it is")
                    return kept.get("final_loss")
                set_aside_failure(run_dir)
            from ampctl.runner.run import run_training  # torch: imported by a run, not by --help or completion

            if is_main_process():
                held.enter_context(holding(run.run_dir))
            summary = run_training(run)
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every way a run ends: outcomes.ENDINGS
            return ended(exc, cfg, run_dir, hydra_cfg, multirun)
    if Path(summary["run_dir"]) != run_dir and is_main_process():
        remove_if_only_hydra_files(run_dir)  # resumed into the checkpoint's own run dir
    return summary.get("final_loss")


def ended(exc: BaseException, cfg: DictConfig, run_dir: Path, hydra_cfg: DictConfig, multirun: bool) -> float:
    """The run ended with exc: in a sweep, a failure the table lets the sweep go on past is recorded and the next
    job runs (its objective NaN); otherwise the command leaves with its lines, as outcomes.ENDINGS says."""
    exc = interrupt_behind(exc) or exc  # an error a stop signal caused is that signal
    outcome = outcome_of(exc)
    if multirun and ENDINGS[outcome].sweep_goes_on:
        if outcome is Outcome.BUG:
            log.exception("job failed")
        return record_failed_job(run_dir, exc)
    sweep = the_sweeps_command(hydra_cfg) if multirun else None
    if outcome is Outcome.STOPPED_ON_SIGNAL:
        assert isinstance(exc, Interrupted)
        if host_of(exc.signum) is not None:
            lines, code = handed_over(exc, sweep)
            leave(exc, lines, log=log.warning, host_exit_code=code)
        leave(exc, interrupted_lines(exc, cfg, sweep) if is_main_process() else [], log=log.warning)
    if outcome is Outcome.INTERRUPTED:  # outside the loop: building, compiling, loading data, the summary
        name = signal_name(exc)

        def said() -> list[str]:  # after the clean-up: whether the run dir is still there says what continues
            where = (f"outside the training loop; continue the sweep with: {sweep}" if sweep is not None else
                     f"outside the training loop; continue with: {continue_command(run_dir)}" if run_dir.is_dir()
                     else "before the first step; nothing recorded")
            return [f"\nampctl train: interrupted ({name}) {where}"]

        leave(exc, said, run_dir)
    if outcome is Outcome.TRAINING_FAILED:
        said = [f"ampctl train: stopped: {exc}"]
        if isinstance(exc, RecipeFailed):  # the user's own frames on the terminal, the whole traceback in the log
            log.error(exc.full_traceback.rstrip())
            log_file = run_dir / run_files.TRAIN_LOG
            said += ["the recipe's own frames (the whole traceback is in " + (str(log_file) if log_file.is_file()
                                                                                else "the run's log") + "):",
                     *[frame.rstrip("\n") for frame in exc.frames]]
        leave(exc, said, log=log.error)
    if outcome is Outcome.REFUSED:
        leave(exc, [f"ampctl train: error: {exc}"], run_dir)
    if outcome is Outcome.WRITE_REFUSED:  # a full disk, a read-only directory: the machine's answer, not a bug
        kept = ("; the checkpoints written before it are whole (resume=auto continues from the newest once it can "
                "write)") if checkpoint_files.list_checkpoints(run_dir) else "; no checkpoint was written"
        leave(exc, [write_refused_line("train", exc, kept)], run_dir)  # type: ignore[arg-type]
    raise exc


def interrupted_lines(exc: Interrupted, cfg: DictConfig, sweep: Optional[str]) -> list[str]:
    """What a run stopped by a signal says: where it stopped, and how it continues (its sweep's command, or its
    own; under SLURM with the preemption signal, the requeue)."""
    where = f"checkpoint {exc.checkpoint}" if exc.checkpoint else "no checkpoint"
    lines = [f"ampctl train: interrupted at step {exc.step} by {signal.Signals(exc.signum).name}; {where}"]
    if sweep is not None:  # a sweep's job continues with its sweep
        lines.append(f"continue the sweep with: {sweep}")
    elif exc.checkpoint:
        lines.append(f"continue with: {continue_command(Path(exc.checkpoint).parent.parent)}")
        preempt = cfg.train.cluster.preempt_signal
        if cfg.train.cluster.slurm_requeue and preempt is not None and exc.signum == signal.Signals[preempt.value]:
            from ampctl.runner.requeue import requeue

            lines += [line for line in [requeue()] if line]
    return lines


def handed_over(exc: Interrupted, sweep: Optional[str]) -> tuple[list[str], Optional[int]]:
    """A stop on the warning of the engine that runs ampctl (submitit's SIGUSR2 before a time limit), its checkpoint
    written: the signal handed to the engine's own handler, which requeues the job (the requeued job continues this
    run: runner/requeue.py) and exits with its code. Its lines, and that code (None: the engine did not end it)."""
    where = f"checkpoint {exc.checkpoint}" if exc.checkpoint else "no checkpoint"
    name, host = signal.Signals(exc.signum).name, host_of(exc.signum)
    said = f"ampctl train: interrupted at step {exc.step} by {name} ({host}'s warning); {where}"
    code, refused = hand_over(exc.signum)
    if refused is None and code is not None:
        return [said, f"{host} requeued the job: it continues this run from its newest checkpoint when it starts "
                      "again"], code
    then = f"continue the sweep with: {sweep}" if sweep is not None else \
        f"continue with: {continue_command(Path(exc.checkpoint).parent.parent)}" if exc.checkpoint else ""
    why = f" ({refused})" if refused else ""
    return [said, f"{host} did not requeue the job{why}" + (f"; {then}" if then else "")], None


def finished_job(run_dir: Path, steps: int) -> Optional[dict]:
    """A resumed sweep's job that finished before (its summary, of this many steps), or None: it runs."""
    from ampctl.reports.runs import read_summary

    summary = read_summary(run_dir / run_files.SUMMARY)
    return summary if summary is not None and summary.get("steps") == steps else None


def set_aside_failure(run_dir: Path) -> None:
    """A resumed sweep runs a failed job again: the earlier attempt's error is kept beside, not read as this one's."""
    error = run_dir / run_files.ERROR
    if error.is_file():
        error.rename(error.with_name(f"{run_files.ERROR}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"))


def the_sweeps_command(hydra_cfg: DictConfig) -> Optional[str]:
    """The command that continues the sweep this job is part of (from the sweep's multirun.yaml)."""
    sweep_dir = Path(hydra_cfg.sweep.dir)
    identity = SweepIdentity.recorded(sweep_dir)
    return identity.command(sweep_dir) if identity is not None else None


def continue_command(run_dir: Path) -> str:
    """The command that continues this run: its config is in its checkpoints, so only the run is named."""
    resume = f"resume={shlex.quote(str(run_dir))}"
    world, local = torchrun_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world == 1:
        return f"ampctl train {resume}"
    nodes = f"--nnodes={world // local} <this job's rendezvous options> " if world != local else ""
    return f"torchrun {nodes}--nproc-per-node={local} -m ampctl train {resume}"


def record_failed_job(run_dir: Path, exc: BaseException) -> float:
    """The job's error, one line, in its directory (the sweep's table shows it; the traceback is in train.log).
    Returns NaN, the objective of a failed trial for a sweeper plugin (Optuna marks it failed and goes on)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = text if isinstance(exc, (UsageError, RunStopped)) else f"{type(exc).__name__}: {text}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / run_files.ERROR).write_text(message + "\n", encoding="utf-8")
    print(f"ampctl train: job in {run_dir} failed: {message}", file=sys.stderr)
    return float("nan")


def plan(cfg: DictConfig, hydra_cfg: DictConfig) -> "RunPlan":
    """The run planned: a resumed run's own config and choices, with the changes the command line names, its
    checkpoint, its policy and trackers checked (runner/plan.py); UsageError for what it refuses. A batch job its
    engine requeued, and a sweep's job its engine retried, continue their own run."""
    from ampctl.runner.plan import continuing_a_jobs_earlier_attempt, continuing_a_requeued_job, plan_run

    run_dir = main_run_dir(hydra_cfg)
    cfg = continuing_a_requeued_job(cfg, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        cfg = continuing_a_jobs_earlier_attempt(cfg, run_dir, hydra_cfg.job.num)
    planned = plan_run(cfg, run_dir, dict(hydra_cfg.runtime.choices), task_overrides(hydra_cfg),
                       torchrun_world_size())
    if hydra_cfg.mode != RunMode.MULTIRUN:  # a sweep's finished job is kept in its turn (train, above)
        nothing_to_do_in_a_finished_run(planned)
    return planned


def nothing_to_do_in_a_finished_run(run: "RunPlan") -> None:
    """A resume into a run that finished where this one would (its summary, of train.steps steps, and its last
    checkpoint at that step): NothingToDo, before anything is written. One whose end was not recorded (killed after
    its last checkpoint) is resumed: it records its end."""
    step = run.resume.step
    if step is None or step != run.cfg.train.steps or finished_job(run.run_dir, step) is None:
        return
    raise NothingToDo(f"{run.run_dir} finished at step {step} ({run.run_dir / run_files.SUMMARY}): nothing to do, "
                      f"nothing changed; to train it longer: resume={run.cfg.resume} train.steps=N with N > {step}",
                      run.run_dir)


def claim_directory(cfg: DictConfig, run_dir: str) -> None:
    """A new run only into a directory of its own; a resume (a requeued batch job's too) only into the run it
    continues. Rank 0's: the other ranks record nothing (run.dir=.)."""
    if not is_main_process():
        return
    from ampctl.runner.identity import requeued_here
    from ampctl.runner.ownership import refuse_another_runs_directory

    requeued = not cfg.resume and requeued_here(Path(run_dir), cfg) is not None
    refuse_another_runs_directory(run_dir, "auto" if requeued else cfg.resume)


def check(cfg: DictConfig) -> None:
    """A sweep's job, checked before the first starts (each is planned again as it starts: runner/plan.py)."""
    from ampctl.runner.plan import check_config
    from ampctl.runner.trackers import check_loggers

    check_config(cfg)
    check_loggers(cfg.logger)


def train_from_python(overrides: Sequence[str] = (), *, run_dir: Optional[PathLike] = None,
                      config_dir: Optional[PathLike] = None, config_name: str = "train") -> Result:
    """`ampctl train [overrides]`: one training run; returns its summary and run directory."""
    from ampctl.runner.run import run_training

    try:
        with planned_run("train", config_name, overrides, run_dir, config_dir) as (run, _hydra_cfg, _out):
            summary = run_training(run)
    except NothingToDo as finished:  # the run's own summary, untouched
        return Result(finished.run_dir, json.loads((finished.run_dir / run_files.SUMMARY).read_text()))
    return Result(Path(summary["run_dir"]), summary)


train_from_python.__name__ = train_from_python.__qualname__ = "train"

COMMAND = Command(name="train", summary="train a recipe under a precision mode (a Hydra app: try --help)",
                  section=Section.RUN, main=train, api=train_from_python, schema=AmpctlConfig, check=check,
                  plan=plan, claim_directory=claim_directory, spans_torchrun_ranks=True, continues_sweeps=True)
