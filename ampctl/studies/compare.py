"""`ampctl compare`: the same recipe, seed and batches under several precision modes, one table.

Each mode trains in its own `ampctl train` process, so that no mode inherits another's allocator caches,
compiled kernels or peak-memory high-water mark; its run directory is a subfolder of the comparison's. After
the warm-up (compare.warmup_steps) the modes take turns in compare.rounds rounds (studies/rounds.py), so that
their timings are taken side by side and a speedup has an interval (reports/round_stats.py).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ampctl import io, run_files
from ampctl.analysis import cpu_figures, cpu_speed, mode_advice
from ampctl.conf import precision_schedule
from ampctl.conf.composing import compose_job
from ampctl.engine.activation_checkpointing import require_checkpoint_blocks
from ampctl.engine.evaluation import held_out_unavailable
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.telemetry import read_metrics
from ampctl.errors import ModeUnsupported, UnsupportedError, UsageError
from ampctl.interrupt import StoppedOnSignal
from ampctl.recipes.base import build_recipe
from ampctl.reports import comparison, round_stats, tables
from ampctl.reports.runs import load_run
from ampctl.runner.plan import check_config
from ampctl.studies import row_labels
from ampctl.studies.rounds import RoundRun, run_in_rounds
from ampctl.studies.turns import round_spans, threads_left_free

# The modes `ampctl compare` runs when compare.precisions is null (those the device can run).
DEFAULT_COMPARE_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "O2")


@dataclass
class ModePlan:
    mode: str
    overrides: list[str]  # for its `ampctl train` process
    steps: int
    device: str = "cpu"
    half: Optional[str] = None  # the half type its matmuls run in (bfloat16, float16), if any


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
        if key == "train.checkpoint.mirror":  # one run per mirror: the modes' runs would refuse each other's
            raise UsageError(f"{override!r}: ampctl compare's runs are measurements of its own and are not mirrored; "
                             "train.checkpoint.mirror is for an ampctl train run")
        if not key.startswith("compare.") and key != "train.seed":  # each run's seed is compare's (compare.seeds)
            run_overrides.append(override)
    return run_overrides


def plan_modes(cfg: DictConfig, run_overrides: list[str], candidates: Sequence[str] = DEFAULT_COMPARE_PRECISIONS,
               ) -> tuple[list[ModePlan], dict[str, str]]:
    """The modes to run, each with its overrides, and the modes skipped with the reason: compare.precisions, or the
    candidates that run at speed here."""
    explicit = cfg.compare.precisions is not None
    names = [precision_schedule.row_label(name) for name in (cfg.compare.precisions if explicit else candidates)]
    checkpointing = ([cfg.train.activation_checkpointing] if cfg.compare.activation_checkpointing is None
                     else list(cfg.compare.activation_checkpointing))
    # one setting for every mode (FP8 is not credited with compile's gain), or each mode both ways
    compiling = [cfg.train.compile.enabled] if cfg.compare.compile is None else list(cfg.compare.compile)
    optimizers = [None] if cfg.compare.optimizers is None else list(cfg.compare.optimizers)
    plans, skipped = [], {}
    for name in names:
        for optimizer in optimizers:
            named = optimizer if len(optimizers) > 1 else None  # the label names it where rows differ by it
            row = row_labels.label(name, False, False, both_compiled=False, both_checkpointed=False, optimizer=named)
            try:
                overrides, mode_cfg, policy = _checked_row(name, optimizer, run_overrides)
            except ModeUnsupported as exc:  # the mode's, whatever the optimizer: said once
                skipped[name] = exc.reason
                break
            except UnsupportedError as exc:  # this mode with this optimizer
                skipped[row] = str(exc)
                continue
            except UsageError as exc:  # a mode and an optimizer that do not go together (SR over fp32 weights)
                if optimizer is None:
                    raise
                skipped[row] = str(exc)
                continue
            slow = mode_advice.slow_here(policy)
            if not explicit and slow:
                skipped[name] = f"{slow}; name it in compare.precisions to run it"
                break
            for compiled in compiling:
                for ac in checkpointing:
                    label = row_labels.label(name, compiled, ac, both_compiled=len(compiling) > 1,
                                             both_checkpointed=len(checkpointing) > 1, optimizer=named)
                    switches = [f"train.activation_checkpointing={str(ac).lower()}",
                                f"train.compile.enabled={str(compiled).lower()}"]
                    plans.append(ModePlan(label, [*overrides, *switches], mode_cfg.train.steps,
                                          policy.device.type,
                                          str(policy.dtype).removeprefix("torch.") if policy.uses_half else None))
    if True in checkpointing and plans:  # refused here rather than in every mode's process
        recipe = build_recipe(mode_cfg.recipe)
        require_checkpoint_blocks(recipe, type(recipe).__name__)
    if not plans:
        raise UsageError(f"none of compare.precisions={names} can run here: " +
                         "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    return plans, skipped


def _checked_row(mode: str, optimizer: Optional[str], run_overrides: list[str],
                 ) -> tuple[list[str], DictConfig, PrecisionPolicy]:
    """A row's overrides, its composed config and its checked policy (UnsupportedError where it cannot run here)."""
    overrides = [*precision_schedule.row_overrides(mode), *([f"optimizer={optimizer}"] if optimizer else []),
                 *run_overrides]
    without_scaler_keys = [o for o in overrides if not o.lstrip("+~").startswith("scaler.")]
    mode_cfg = compose_job("train", without_scaler_keys)
    if mode_cfg.scaler.kind == "none":  # scaler.* settings are for the modes that scale; fp32 and bf16 keep none
        overrides = without_scaler_keys
    else:
        mode_cfg = compose_job("train", overrides)
    return overrides, mode_cfg, check_config(mode_cfg)


class CompareInterrupted(StoppedOnSignal):
    """Ctrl-C (or SIGTERM) during a comparison, or its deadline passed: the running modes stopped with a
    checkpoint; the modes started until then. run_compare writes their comparison before it lets this go."""

    def __init__(self, signum: int, started: list[str], out_of_time: bool = False) -> None:
        self.started, self.out_of_time = started, out_of_time
        super().__init__(signum, "its deadline passed" if out_of_time else signal.Signals(signum).name)


def every_runs_overrides(cfg: DictConfig, plans: list[ModePlan], console: Console) -> list[str]:
    """What every mode's run takes beside its own overrides: its held-out evaluation and, on a busy CPU, the threads
    left free (each said, where there is something to say)."""
    overrides, no_evaluation = evaluation_overrides(cfg, plans[0].steps)
    if no_evaluation:
        tables.print_line(console, f"  no held-out evaluation: {no_evaluation}")
    threads = threads_left_free(cfg, [plan.device for plan in plans])
    if threads is not None:
        tables.print_line(console, f"  {threads.said}")
        overrides.append(f"train.threads={threads.threads}")
    return overrides


def enough_steps(cfg: DictConfig, plans: list[ModePlan]) -> list[tuple[int, int]]:
    """The rounds' steps, where train.steps holds them and train.profile's window; refused in one line naming each
    key that needs more steps (the rounds alone were said first, and train.profile's refusal came after the fix)."""
    problems, spans = [], []
    try:
        spans = round_spans(cfg, plans[0].steps)
    except UsageError as exc:
        problems.append(str(exc))
    try:
        refuse_a_profile_past_the_end(cfg, plans)
    except UsageError as exc:
        problems.append(str(exc))
    if problems:
        raise UsageError("; and ".join(problems))
    return spans


def refuse_a_profile_past_the_end(cfg: DictConfig, plans: list[ModePlan]) -> None:
    """train.profile=N with too few steps for any mode's run: refused once, before any mode runs (each run refused
    it alone, each mode a failed row)."""
    from ampctl.analysis.memory.measure import MEASURED_STEPS
    from ampctl.runner.profile_window import first_profiled_step

    for plan in plans:
        memory = MEASURED_STEPS if plan.device == "cpu" and cfg.telemetry.profile_cpu_memory else 0
        said = [o.split("=", 1)[1] for o in plan.overrides if o.startswith("train.compile.enabled=")]
        compiled = said[-1] == "true" if said else cfg.train.compile.enabled
        first_profiled_step(cfg.train.profile, plan.steps, max(cfg.compare.warmup_steps, memory, int(compiled)))


def evaluation_overrides(cfg: DictConfig, steps: int) -> tuple[list[str], Optional[str]]:
    """train.eval.every for every mode's run: the user's own, or (none set) one evaluation at the end where the
    recipe has held-out batches; and why there is none, where there is none."""
    if cfg.train.eval.every is not None:
        return [], None
    reason = held_out_unavailable(build_recipe(cfg.recipe))
    return ([], reason) if reason else ([f"train.eval.every={steps}"], None)


def run_compare(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str],
                planned: Optional[tuple[list[ModePlan], dict[str, str]]] = None,
                deadline: Optional[float] = None, part_of: Optional[str] = None) -> int:
    """Run every mode in turns, seed after seed, then write the table, CSV, JSON, report.md and plots. Returns the
    number of failed runs. Interrupted, it writes the comparison of the runs so far and raises CompareInterrupted.
    planned: the plans and skipped modes of plan_modes, with settings of their own (ampctl advise's). deadline
    (time.monotonic()): a seed whose runs would end past it (as long as the seed before took) is not started, and
    runs still going when it passes are stopped, as by SIGTERM (CompareInterrupted, out_of_time). part_of: the
    study it is a phase of (advise), which says what it compares and what it found: its progress alone on the
    screen, its table and notes in its report.md (they repeated the study's own lines)."""
    plans, skipped = planned if planned is not None else plan_modes(cfg, split_overrides(task_overrides))
    skipped = dict(skipped)
    spans = enough_steps(cfg, plans)
    seeds = [cfg.train.seed + i for i in range(cfg.compare.seeds)]
    console = tables.make_console()
    out_dir.mkdir(parents=True, exist_ok=True)
    turns = (f"in {len(spans)} rounds of turns (steps {spans[0][0]}-{spans[-1][1]})" if len(spans) > 1
             else "one after another")
    each_seed = f"seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    if part_of is None:
        tables.print_line(console, f"ampctl compare: {', '.join(p.mode for p in plans)} on the same recipe and "
                                   f"batches, {each_seed}; each run in its own process, {turns} -> {out_dir}")
        if skipped:  # why, once, under the table
            tables.print_line(console, f"  skipped {', '.join(skipped)}: why under the table")
    every_run = every_runs_overrides(cfg, plans, console)
    started: list[RoundRun] = []
    interrupted, ran_seeds, seed_s = None, [], 0.0
    for seed in seeds:
        if deadline is not None and ran_seeds and time.monotonic() + seed_s > deadline:
            tables.print_line(console, f"  seeds {', '.join(map(str, seeds[len(ran_seeds):]))} not run: another "
                                       f"seed would end past the deadline (seed {ran_seeds[-1]} took {seed_s:.0f} s)")
            break
        seed_started = time.monotonic()
        ran_seeds.append(seed)
        runs = []
        for plan in plans:
            run_dir = comparison.run_dir(out_dir, plan.mode, seed, len(seeds) > 1)
            command = child_command(plan, run_dir, cfg.compare.warmup_steps, config_dir,
                                    [*every_run, f"train.seed={seed}"])
            runs.append(RoundRun(plan.mode, command, run_dir, plan.steps))
        started += run_with_progress(runs, spans, console, f"seed {seed}: " if len(seeds) > 1 else "", deadline)
        seed_s = time.monotonic() - seed_started
        interrupted = next((run for run in started if run.stopped_by is not None), None)
        if interrupted is not None:
            break
    modes = list(dict.fromkeys(run.label for run in started))
    if interrupted is not None:
        why = ("its deadline passed" if interrupted.out_of_time
               else f"was interrupted ({signal.Signals(interrupted.stopped_by).name})")
        for plan in plans:
            if plan.mode not in modes:
                skipped[plan.mode] = f"not run: the comparison {why} before it started"
    failed = write_comparison_report(out_dir, modes, skipped, task_overrides, console if part_of is None else None,
                                     spans, ran_seeds, len(seeds) > 1)
    for line in recheck_cpu_probe(plans, out_dir):
        tables.print_line(console, line)
    if interrupted is not None:
        raise CompareInterrupted(interrupted.stopped_by, modes, interrupted.out_of_time)
    return failed


def recheck_cpu_probe(plans: list[ModePlan], out_dir: Path) -> list[str]:
    """A comparison on a CPU that contradicts the CPU probe (a half mode measured faster than fp32 where the probe
    said it is slow, or more than SLOW_FACTOR slower where it said it runs at speed: intervals that exclude the
    probe's verdict) has the CPU measured again, so that list, the warnings and the next comparison's default
    modes follow what was measured. Returns the lines that say so."""
    rows = {r["precision"]: r for r in json.loads((out_dir / f"{run_files.COMPARISON}.json").read_text())["rows"]}
    probe = cpu_speed.measured()
    baseline = comparison.baseline_of([plan.mode for plan in plans])
    optimizer = row_labels.parse(baseline).optimizer if baseline else None
    contradicted = []
    for plan in plans:
        row = rows.get(plan.mode, {})
        if plan.device != "cpu" or plan.half is None or row.get("speedup_low") is None:
            continue
        if row_labels.parse(plan.mode).optimizer != optimizer:  # its speed is its optimizer's too, not the dtype's
            continue
        at_speed, slow_speedup = probe.runs_at_speed(plan.half), 1 / cpu_figures.SLOW_FACTOR
        if (not at_speed and row["speedup_low"] > 1) or (at_speed and row["speedup_high"] < slow_speedup):
            contradicted.append(f"{plan.mode} measured {row['speedup']:.2f}x fp32's speed here "
                                f"({row['speedup_low']:.2f}-{row['speedup_high']:.2f}) where the CPU probe said "
                                f"{plan.half} {'runs at speed' if at_speed else 'is slow'}")
    if not contradicted:
        return []
    again = cpu_speed.measured(remeasure=True)
    return [f"{'; '.join(contradicted)}: the CPU was measured again ({cpu_speed.cache_path()}):",
            *(f"  {line}" for line in again.describe())]


def child_command(plan: ModePlan, run_dir: Path, warmup_steps: int, config_dir: Optional[str],
                  extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "ampctl", "train", *(["-cd", config_dir] if config_dir else []), *plan.overrides,
            *extra, f"hydra.run.dir={run_dir}", "train.console=quiet", f"train.timing_warmup_steps={warmup_steps}"]


def rerender(out_dir: Path, console: Console) -> int:
    """`ampctl report` of a comparison's directory, from its comparison.json."""
    meta = json.loads((out_dir / f"{run_files.COMPARISON}.json").read_text())
    spans = [tuple(span) for span in meta["rounds"]] if meta.get("rounds") else None
    return write_comparison_report(out_dir, meta["modes"], meta.get("skipped", {}), meta.get("overrides", []), console,
                                   spans, meta.get("seeds"), meta.get("per_seed"))


def write_comparison_report(out_dir: Path, modes: list[str], skipped: dict[str, str], overrides: list[str],
                            console: Optional[Console], spans: Optional[list[tuple[int, int]]],
                            seeds: Optional[list[int]] = None, per_seed: Optional[bool] = None) -> int:
    """Table, comparison.csv/.json, report.md and plots from the runs' directories (per_seed: a directory for each
    seed's run, as a comparison planned with several seeds has, however many ran); the table and its notes on the
    console too (None: the files alone). Returns the failed runs."""
    seeds = seeds or [None]  # type: ignore[list-item]  # a comparison recorded before seeds: one run a mode
    per_seed = len(seeds) > 1 if per_seed is None else per_seed
    directories = {mode: [comparison.run_dir(out_dir, mode, seed, per_seed) for seed in seeds] for mode in modes}
    runs = [(mode, [load_run(d) for d in dirs if d.is_dir()]) for mode, dirs in directories.items()]
    table = comparison.comparison_table(runs, skipped, spans)
    if console is not None:
        tables.print_table(table, console)  # first: a directory that cannot be written still shows its report
    images = comparison.comparison_images(runs, table, out_dir)
    machine = tables.machine_info([run.summary for _, records in runs for run in records if run.summary])
    extra = {"kind": "compare", "modes": modes, "skipped": skipped, "overrides": overrides,
             "rounds": [list(span) for span in spans] if spans else None, "seeds": seeds, "per_seed": per_seed}
    files = tables.write_files(table, out_dir, run_files.COMPARISON, machine, images, extra)
    if console is not None:
        console.print(tables.wrote([*files, *images], out_dir))
    return sum(run.failed for _, records in runs for run in records)


ROUND_LINES = 5  # lines a seed's rounds are said in, at most (the table has them all)


def run_with_progress(runs: list[RoundRun], spans: list[tuple[int, int]], console: Console,
                      prefix: str = "", deadline: Optional[float] = None) -> list[RoundRun]:
    """run_in_rounds with a progress bar over every mode's steps (or plain lines off a terminal): a line as each
    round ends, with each mode's median step time in it, and as each mode ends."""
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
        disable=not console.is_terminal,
    )
    say = progress.console.print if console.is_terminal else (lambda text: print(text, flush=True))
    overall = progress.add_task("compare", total=sum(run.steps for run in runs))
    round_ends = [first - 1 for first, _ in spans] if len(spans) > 1 else []

    said_every = max(1, round(len(spans) / ROUND_LINES))  # many short rounds: a line every few of them

    def on_round(r: int) -> None:
        progress.update(overall, description=f"{prefix}round {min(r + 1, len(spans))}/{len(spans)}")
        if console.is_terminal or (r % said_every and r != len(spans)):
            return  # a terminal has the bar (the table below says what the rounds came to); a log a line a few
        figures = []
        for run in runs:
            (ms,) = round_stats.round_medians(load_rows(run.run_dir), [spans[r - 1]])
            figures.append(f"{run.label} {'-' if ms is None else io.milliseconds(ms)} ms")
        say(f"{prefix}round {r}/{len(spans)}: median step {', '.join(figures)}")

    def on_finished(run: RoundRun) -> None:
        record = load_run(run.run_dir) if run.error is None or run.stopped_by is not None else None
        if record is not None and record.failed:
            why = record.why_not_ok or ""
            status = why if why.startswith(record.status) else f"{record.status}: {why}"
        elif record is None:
            status = f"failed: {run.error}"
        else:
            status = f"done in {time.perf_counter() - run.started_at:.1f} s"
        say(f"{prefix}{run.label}: {status}")

    if not console.is_terminal:
        print(f"{prefix}training {io.count_of(len(runs), 'mode')} x {io.count_of(runs[0].steps, 'step')}"
              + (f" in {io.count_of(len(spans), 'round')}" if round_ends else ""), flush=True)
    with progress:
        started = run_in_rounds(runs, round_ends, lambda done: progress.update(overall, completed=done),
                               on_round, on_finished, deadline)
    for run in started:
        if run.error and run.stopped_by is None:  # a mode refused before its first step left no directory
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / run_files.ERROR).write_text(run.error + "\n")
    return started


def load_rows(run_dir: Path) -> list[dict]:
    """A running mode's rows so far (its window is written before it pauses)."""
    metrics = run_dir / run_files.METRICS
    if not metrics.is_file():
        return []
    return [dataclasses.asdict(r) for r in read_metrics(metrics)]
