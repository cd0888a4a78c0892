"""`ampctl compare`: the same recipe, seed and batches under several precision modes, one table.

Each mode trains in its own `ampctl train` process, one after the other, so that no mode inherits another's
allocator caches, compiled kernels or peak-memory high-water mark; its run directory is a subfolder of the
comparison's. Timings leave out the warm-up steps (compare.warmup_steps) and use medians.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ampctl.conf.messages import one_line
from ampctl.conf.schema import DEFAULT_COMPARE_PRECISIONS
from ampctl.engine.activation_checkpointing import require_checkpoint_blocks
from ampctl.engine.build import check_config
from ampctl.errors import UnsupportedError, UsageError
from ampctl.recipes.base import build_recipe
from ampctl.reports import tables
from ampctl.reports.runs import ERROR_FILE, load_run

CHILD_LOG = "compare_child.log"


@dataclass
class ModePlan:
    mode: str
    overrides: list[str]  # for its `ampctl train` process
    steps: int


def split_overrides(task_overrides: list[str]) -> list[str]:
    """The user's overrides that go to every mode's training run (compare.* stays here)."""
    run_overrides = []
    for override in task_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "precision" or key.startswith("precision."):
            raise UsageError(
                f"{override!r}: ampctl compare chooses the precision of each run; "
                "list the modes with compare.precisions=[fp32,bf16,...]"
            )
        if key == "resume":
            raise UsageError(f"{override!r}: ampctl compare starts fresh runs; resume a single mode's run with "
                             "ampctl train resume=<its run dir>")
        if not key.startswith("compare."):
            run_overrides.append(override)
    return run_overrides


def plan_modes(cfg: DictConfig, run_overrides: list[str]) -> tuple[list[ModePlan], dict[str, str]]:
    """The modes to run, each with its overrides, and the modes skipped with the reason."""
    options = GlobalHydra.instance().config_loader().get_group_options("precision")
    explicit = cfg.compare.precisions is not None
    names = list(cfg.compare.precisions) if explicit else list(DEFAULT_COMPARE_PRECISIONS)
    for name in names:
        if name not in options:
            raise UsageError(f"compare.precisions: {name!r} is not a precision mode; choose from {', '.join(options)}")
    if len(set(names)) != len(names) or not names:
        raise UsageError(f"compare.precisions={names}: give one or more distinct precision modes")
    checkpointing = ([cfg.train.activation_checkpointing] if cfg.compare.activation_checkpointing is None
                     else list(cfg.compare.activation_checkpointing))
    if not checkpointing or len(set(checkpointing)) != len(checkpointing):
        raise UsageError(f"compare.activation_checkpointing={checkpointing}: give [false], [true] or [false,true]")
    # one setting for every mode (FP8 is not credited with compile's gain), or each mode both ways
    compiling = [cfg.train.compile] if cfg.compare.compile is None else list(cfg.compare.compile)
    if not compiling or len(set(compiling)) != len(compiling):
        raise UsageError(f"compare.compile={compiling}: give [false], [true] or [false,true]")
    plans, skipped = [], {}
    for name in names:
        overrides = [f"precision={name}", *run_overrides]
        without_scaler_keys = [o for o in overrides if not o.lstrip("+~").startswith("scaler.")]
        try:
            mode_cfg = _compose_train(without_scaler_keys)
            if mode_cfg.scaler.kind == "none":
                # scaler.* settings are for the modes that scale; fp32 and bf16 keep scaler=none
                overrides = without_scaler_keys
            else:
                mode_cfg = _compose_train(overrides)
            policy = check_config(mode_cfg)
        except UnsupportedError as exc:
            skipped[name] = str(exc).split("; ")[0].removeprefix(f"precision={name} ")
            continue
        slow = policy.slow_here()
        if not explicit and slow:
            skipped[name] = f"{slow}; name it in compare.precisions to run it"
            continue
        for compiled in compiling:
            for ac in checkpointing:
                label = (name + ("+compile" if compiled and len(compiling) > 1 else "")
                         + ("+ac" if ac and len(checkpointing) > 1 else ""))
                plans.append(ModePlan(label, [*overrides, f"train.activation_checkpointing={str(ac).lower()}",
                                              f"train.compile={str(compiled).lower()}"], mode_cfg.train.steps))
    if True in checkpointing and plans:  # refused here rather than in every mode's process
        recipe = build_recipe(mode_cfg.recipe)
        require_checkpoint_blocks(recipe, type(recipe).__name__)
    if not plans:
        raise UsageError(f"none of compare.precisions={names} can run here: " +
                         "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    return plans, skipped


def _compose_train(overrides: list[str]) -> DictConfig:
    try:
        return compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(one_line(exc)) from None


class CompareInterrupted(Exception):
    """Ctrl-C (or SIGTERM) during a comparison: the running mode stopped with a checkpoint; the modes started
    until then. run_compare writes their comparison before it lets this go."""

    def __init__(self, signum: int, started: list[str]) -> None:
        self.signum, self.started = signum, started
        super().__init__(signal.Signals(signum).name)


def run_compare(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str]) -> int:
    """Run every mode, then write the table, CSV, JSON, report.md and plots. Returns the number of failed modes.
    Interrupted, it writes the comparison of the modes run so far and raises CompareInterrupted."""
    plans, skipped = plan_modes(cfg, split_overrides(task_overrides))
    console = tables.make_console()
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"ampctl compare: {', '.join(p.mode for p in plans)} on the same recipe, seed and batches; "
                  f"each in its own process -> {out_dir}")
    for mode, reason in skipped.items():
        console.print(f"  skipped {mode}: {reason}")
    try:
        return write_comparison_report(out_dir, run_all(plans, cfg.compare.warmup_steps, out_dir, config_dir,
                                                        console), skipped, task_overrides, console)
    except CompareInterrupted as stop:
        for plan in plans[len(stop.started):]:
            skipped[plan.mode] = f"not run: the comparison was interrupted ({stop})"
        write_comparison_report(out_dir, stop.started, skipped, task_overrides, console)
        raise


def write_comparison_report(
    out_dir: Path, modes: list[str], skipped: dict[str, str], overrides: list[str], console: Console
) -> int:
    """Table, comparison.csv/.json, report.md and plots from the modes' run directories. Returns failed count."""
    runs = [(mode, load_run(out_dir / mode)) for mode in modes]
    table = tables.comparison_table(runs, skipped)
    images = tables.comparison_images(runs, table, out_dir)
    machine = tables.machine_info([run.summary for _, run in runs if run.summary])
    extra = {"kind": "compare", "modes": modes, "skipped": skipped, "overrides": overrides}
    files = tables.write_files(table, out_dir, "comparison", machine, images, extra)
    tables.print_table(table, console)
    console.print(f"wrote {', '.join(p.name for p in [*files, *images])} in {out_dir}")
    return sum(run.failed for _, run in runs)


def run_all(
    plans: list[ModePlan], warmup_steps: int, out_dir: Path, config_dir: Optional[str], console: Console
) -> list[str]:
    """Train each plan's mode in turn. Returns the modes started: all of them, unless a Ctrl-C stopped the
    comparison (the mode it reached stopped with a checkpoint, the later ones not started)."""
    total = sum(p.steps for p in plans)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
        disable=not console.is_terminal,
    )
    started: list[str] = []
    with progress:
        overall = progress.add_task("compare", total=total)
        done_steps = 0
        for index, plan in enumerate(plans, 1):
            label = f"[{index}/{len(plans)}] {plan.mode}"
            progress.update(overall, description=label)
            if not console.is_terminal:
                print(f"{label}: training {plan.steps} steps", flush=True)
            began = time.perf_counter()
            run_dir = out_dir / plan.mode
            started.append(plan.mode)
            error, interrupted = run_mode(plan, run_dir, warmup_steps, config_dir,
                                          lambda steps: progress.update(overall, completed=done_steps + steps))
            done_steps += plan.steps
            progress.update(overall, completed=done_steps)
            if error and interrupted is None:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / ERROR_FILE).write_text(error + "\n")
            run = load_run(run_dir)
            status = f"{run.status}: {run.why_not_ok}" if run.failed else f"done in {time.perf_counter() - began:.1f} s"
            (progress.console.print if console.is_terminal else lambda text: print(text, flush=True))(
                f"{label}: {status}")
            if interrupted is not None:
                raise CompareInterrupted(interrupted, started)
    return started


def run_mode(plan: ModePlan, run_dir: Path, warmup_steps: int, config_dir: Optional[str],
             on_steps) -> tuple[Optional[str], Optional[int]]:
    """Train one mode in a child process; report its progress from its metrics.jsonl. Returns its error (or
    None) and the signal that stopped it (or None). The child has its own session, so a Ctrl-C at the terminal
    reaches it once, forwarded from here: it finishes its step and writes a checkpoint (it is waited for, never
    killed), and a second Ctrl-C ends it at once, as `ampctl train` alone would."""
    command = [sys.executable, "-m", "ampctl", "train", *(["-cd", config_dir] if config_dir else []),
               *plan.overrides, f"hydra.run.dir={run_dir}", "train.console=quiet",
               f"train.timing_warmup_steps={warmup_steps}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / CHILD_LOG
    metrics = run_dir / "metrics.jsonl"
    received: list[int] = []
    with log_path.open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def forward(signum: int, _frame: object) -> None:
            received.append(signum)
            child.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            while child.poll() is None:
                time.sleep(0.5)
                if metrics.is_file() and not received:
                    on_steps(metrics.read_bytes().count(b"\n"))
        except BaseException:
            child.kill()
            child.wait()
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    stopped_by = received[0] if received else None
    if child.returncode == 0:
        return None, stopped_by
    return _child_error(log_path, child.returncode), stopped_by


def _child_error(log_path: Path, returncode: int) -> str:
    """The child's own error line ("ampctl train: error: ..." or a traceback's last line), not Hydra's."""
    lines = [line.strip() for line in log_path.read_text().splitlines() if line.strip()]
    own = [line.removeprefix("ampctl train: ") for line in lines if line.startswith("ampctl train: ")]
    line = own[-1] if own else lines[-1] if lines else f"exit code {returncode}"
    return f"{line} (see {log_path})"
