"""`ampctl advise`: the precision mode for this model on this machine, with the evidence.

It runs ampctl's own instruments in turn, within advise.budget, each into a directory of its own under the
advice's: inspect (a few fp32 steps with range hooks: the largest gradient, what fp16 flushes, which layers
overflow fp16); a short calibration run (the step's time, to size what follows; and a compiled one, for the
compile time, where compile is a candidate); for each FP8 or MX mode that runs at speed here (or is named in
compare.precisions) an inspection in that mode (what its format loses of each converted layer); then compare
(the candidates as they would be advised, see advice.prepare; eager and compiled where the budget leaves each run
enough steps; with and without activation checkpointing where memory is the goal) in alternating rounds over
advise's seeds: speedup with its interval, held-out parity with fp32, each mode's peak memory. Then it decides
(studies/advising/advice.py) and writes advice.md, advice.png, advice.json and an experiment config that
`ampctl train -cd <dir> -cn <advise.name>` runs as written. Ctrl-C during the comparison leaves the advice of what
was measured, said to be partial.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict
from rich.console import Console

from ampctl import io, run_files
from ampctl.analysis import cpu_speed
from ampctl.conf import precision_schedule
from ampctl.conf.composing import compose_job
from ampctl.conf.value_checks import budget_seconds
from ampctl.engine.precision import converters
from ampctl.errors import UsageError
from ampctl.reports import tables
from ampctl.reports.comparison import baseline_of
from ampctl.studies import row_labels
from ampctl.studies.advising.advice import GradientEvidence, ModeEvidence, Preparation, decide, is_reference, prepare
from ampctl.studies.advising.advice_report import Findings, write_advice
from ampctl.studies.advising.advise_evidence import gradient_evidence, layer_losses, mode_evidence, model_facts
from ampctl.studies.advising.advise_repair import repaired_plans
from ampctl.studies.advising.advise_variants import compile_is_candidate, with_variants
from ampctl.studies.budget import (
    CALIBRATION_STEPS,
    COMPILED_MIN_STEPS,
    INSPECT_SHARE,
    INSPECTED_STEP_COST,
    MARGIN_S,
    MIN_SEEDS,
    PLANNED_SHARE,
    BudgetClock,
    Candidate,
    ComparisonSize,
    inspected_steps,
    minutes,
    seconds_since_start,
    size_comparison,
)
from ampctl.studies.compare import (
    DEFAULT_COMPARE_PRECISIONS,
    CompareInterrupted,
    ModePlan,
    plan_modes,
    run_compare,
    split_overrides,
)
from ampctl.studies.diffing.diff_repair import own_rules
from ampctl.studies.inspect_ranges import run_inspect
from ampctl.studies.turns import rounds_of

OWN_KEYS = ("advise.", "compare.", "inspect.")  # advise's settings: not the runs'
log = logging.getLogger(__name__)  # advise.log (Hydra's job logging): every line advise says


def candidate_modes() -> tuple[str, ...]:
    """The modes advise weighs: those compare runs by default, then every mode whose YAML names a registered
    converter (FP8, MX, a plug-in's), less the modes that only emulate another (precision=fp8_emulated studies
    fp8's numerics where fp8 cannot run: never the faster or the smaller choice). Each where it runs at speed."""
    emulations = {cls.emulation for cls in converters.registered().values() if cls.emulation}
    options = GlobalHydra.instance().config_loader().get_group_options("precision")
    converted = [option for option in options if option not in (*DEFAULT_COMPARE_PRECISIONS, *emulations)
                 and _names_a_converter(option)]
    return (*DEFAULT_COMPARE_PRECISIONS, *converted)


def _names_a_converter(option: str) -> bool:
    """Whether precision=option's YAML names a converter that exists (not a flag-driven mode, nor a YAML that does
    not compose or names none)."""
    try:
        name = compose_job("train", [f"precision={option}"]).precision.converter
        return name is not None and converters.converter_class(name) is not None
    except UsageError:
        return False


@dataclass
class Advising:
    """What every phase of one advise shares: its config (the comparison's ways and seeds as they are decided),
    the runs' overrides, its directory, the clock, the notes for the advice, and its voice (say: the terminal and
    advise.log). step_s: fp32's step here, once calibrated."""

    cfg: DictConfig
    run_overrides: list[str]
    out_dir: Path
    clock: BudgetClock
    console: Any
    notes: list[str] = field(default_factory=list)
    step_s: float = 0.0
    # studies/diffing/diff.run_diff, which a mode ruled out by its accuracy is repaired with (advise_repair.py):
    # handed over by the command, as the diff's own prover is
    run_diff: Optional[Callable[..., None]] = None

    def say(self, text: str, clocked: bool = True) -> None:
        line = self.clock.line(text) if clocked else text
        tables.print_line(self.console, line, highlight=False)
        log.info(line)


def run_advise(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str],
               run_diff: Optional[Callable[..., None]] = None) -> None:
    budget = budget_seconds(cfg.advise.budget)
    assert budget is not None  # the schema refused anything else
    advising = Advising(cfg, runs_overrides(task_overrides), out_dir, BudgetClock(budget, seconds_since_start()),
                        tables.make_console(), run_diff=run_diff)
    out_dir.mkdir(parents=True, exist_ok=True)
    ends = time.strftime("%H:%M:%S", time.localtime(time.time() + advising.clock.left()))
    advising.say(f"ampctl advise: goal={cfg.advise.goal.value}, budget {cfg.advise.budget} from its start: ends by "
                 f"{ends}, plus up to {MARGIN_S:.0f} s to stop its runs and write the reports -> {out_dir}",
                 clocked=False)
    facts = {"machine": _machine(cfg)}
    advising.say(f"  the machine: {facts['machine']}", clocked=False)
    advising.say(f"calibration: {CALIBRATION_STEPS} steps of fp32, to size each phase to the budget")
    calibration = _calibrate(advising.run_overrides, out_dir / "calibration")
    advising.step_s = float(calibration["median_step_time_ms"]) / 1e3
    inspected = _inspect(advising, out_dir / "inspect", "fp32")
    gradients = gradient_evidence(out_dir / "inspect") if inspected else None
    facts["model"] = model_facts(calibration, out_dir / "inspect" if inspected else None)
    advising.say(f"the model: {facts['model']}")
    compile_measured = compile_is_candidate(advising.cfg, advising.run_overrides, advising.notes)
    advising.cfg = with_variants(advising.cfg, advising.run_overrides, advising.notes, compile_measured)
    plans, skipped = plan_modes(advising.cfg, advising.run_overrides, candidate_modes())
    prepared = _prepare(advising, plans, skipped, gradients)
    compile_s = 0.0
    if compile_measured:
        plans, compile_s = _with_compile_where_it_fits(advising, plans)
    size = size_comparison([_candidate(p, plans) for p in plans], advising.step_s,
                           PLANNED_SHARE * advising.clock.left(), advising.cfg.compare.seeds, compile_s)
    skipped.update(size.dropped)
    plans = [_sized(_prepared_plan(p, prepared), size.steps) for p in plans if p.mode in size.kept]
    interrupted = _compare(advising, size, plans, skipped, config_dir)
    evidence = mode_evidence(out_dir / "compare" if size.runs else None, skipped, size.kept)
    if interrupted is None and run_diff is not None:  # ruled out by its accuracy alone: repaired (advise_repair.py)
        repaired, unhelped = repaired_plans(advising, evidence, plans, prepared)
        evidence += unhelped + (_compare_repaired(advising, [p for p in plans if is_reference(p.mode)] + repaired,
                                                  config_dir) if repaired else [])
    advice = decide(evidence, prepared, advising.cfg.advise.goal.value, advising.notes)
    advising.say("the advice, from what was measured:")
    findings = Findings(advice, evidence, gradients, facts, _partial(interrupted))
    write_advice(out_dir, advising.cfg, findings, advising.run_overrides, advising.console)
    if interrupted is not None and not interrupted.out_of_time:
        raise interrupted


def runs_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's overrides that go to advise's runs (advise's, compare's and inspect's own settings
    apart); refused: a resume (its runs are new ones) and a precision (advise chooses it)."""
    run_overrides = [o for o in task_overrides if not o.lstrip("+~").startswith(OWN_KEYS)]
    for override in run_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume":
            raise UsageError(f"{override!r}: ampctl advise starts runs of its own; continue a run with ampctl train "
                             "resume=<its run dir>")
        if key == "precision" or key.startswith("precision."):
            raise UsageError(f"{override!r}: ampctl advise chooses the precision mode (from those that run at speed "
                             "here); to choose its candidates yourself, compare.precisions=[fp32,bf16,...]")
    split_overrides(run_overrides)
    return run_overrides


def _compare(advising: Advising, size: ComparisonSize, plans: list[ModePlan], skipped: dict[str, str],
             config_dir: Optional[str]) -> Optional[CompareInterrupted]:
    """The comparison as sized (its seeds into advising.cfg), stopped at the budget's end; not run, with a note of why,
    where nothing but fp32 fits. Returns how it was interrupted, if it was."""
    if not size.runs:
        why = ("fp32 is the only candidate that runs here" if not size.dropped else
               f"fp32 and one other mode do not fit the {minutes(advising.clock.left())} left of advise.budget="
               f"{advising.cfg.advise.budget}" + _budget_that_fits(advising, size))
        advising.say(f"compare: not run: {why} (each mode's reason below)")
        advising.notes.append(f"no comparison: {why}; the advice is fp32 by default, not by measurement")
        return None
    if size.fewer_seeds:
        advising.notes.append(f"compare: {size.fewer_seeds} in advise.budget={advising.cfg.advise.budget}"
                              + (_budget_that_fits(advising, size) if size.seeds < MIN_SEEDS else ""))
    advising.cfg = _with_seeds(advising.cfg, size.seeds)
    done_near = time.strftime('%H:%M', time.localtime(time.time() + size.estimate_s))
    advising.say(f"compare {', '.join(size.kept)} x {io.count_of(size.seeds, 'seed')} x "
                 f"{io.count_of(size.steps, 'step')} in {io.count_of(rounds_of(advising.cfg, size.steps), 'round')}: "
                 f"about {size.estimate_s / 60:.1f} min, done near {done_near}")
    try:
        run_compare(advising.cfg, advising.out_dir / "compare", [*advising.run_overrides, f"train.steps={size.steps}"],
                    config_dir, planned=(plans, skipped), deadline=advising.clock.deadline(), part_of="advise")
    except CompareInterrupted as exc:
        return exc
    finally:
        _seeds_that_ran(advising, size)
    return None


def _compare_repaired(advising: Advising, plans: list[ModePlan], config_dir: Optional[str]) -> list[ModeEvidence]:
    """fp32 and the repaired modes, in rounds over advise's seeds, in what is left of the budget: their rows."""
    size = size_comparison([_candidate(p, plans) for p in plans], advising.step_s,
                           PLANNED_SHARE * advising.clock.left(), advising.cfg.compare.seeds)
    labels = [p.mode for p in plans[1:]]
    if not size.runs or size.seeds < advising.cfg.compare.seeds:
        why = ("not compared: fp32 and it do not fit what was left of advise.budget with the comparison's seeds "
               "(ampctl diff diff.repair=true diff.prove=true compares them)")
        return [ModeEvidence(label, skipped=why) for label in labels]
    advising.say(f"compare {', '.join(p.mode for p in plans)} x {io.count_of(size.seeds, 'seed')} x "
                 f"{io.count_of(size.steps, 'step')}: the repaired modes")
    out_dir = advising.out_dir / "compare_repaired"
    try:
        run_compare(advising.cfg, out_dir, [*advising.run_overrides, f"train.steps={size.steps}"], config_dir,
                    planned=([_sized(p, size.steps) for p in plans if p.mode in size.kept], {}),
                    deadline=advising.clock.deadline(), part_of="advise")
    except CompareInterrupted as exc:
        if not exc.out_of_time:
            raise
        advising.notes.append("the repaired modes' comparison was cut by advise.budget: what it measured is weighed")
    return [m for m in mode_evidence(out_dir, {}) if m.mode in labels]


def _seeds_that_ran(advising: Advising, size: ComparisonSize) -> None:
    """A note where the deadline left seeds of the comparison unstarted (the notes said the seeds planned)."""
    record = advising.out_dir / "compare" / f"{run_files.COMPARISON}.json"
    ran = json.loads(record.read_text()).get("seeds", []) if record.is_file() else []
    if 0 < len(ran) < size.seeds:
        advising.notes.append(f"compare: {len(ran)} of the {size.seeds} seeds planned ran before advise.budget's end "
                              "(the runs took longer than their estimate)")


def _budget_that_fits(advising: Advising, size: ComparisonSize) -> str:
    """`; advise.budget=5m would compare them`: the time so far and the comparison's, as the budget's share of it."""
    if size.needed_s is None:
        return ""
    total_s = advising.clock.elapsed() + size.needed_s / PLANNED_SHARE + MARGIN_S
    return f"; advise.budget={math.ceil(total_s / 60)}m would compare fp32 and the cheapest of them"


def _candidate(plan: ModePlan, plans: list[ModePlan]) -> Candidate:
    return Candidate(plan.mode, _relative_time(plan), row_labels.parse(plan.mode).compiled,
                     plan.mode == baseline_of([p.mode for p in plans]))


def _sized(plan: ModePlan, steps: int) -> ModePlan:
    return dataclasses.replace(plan, steps=steps, overrides=[*plan.overrides, f"train.steps={steps}"])


def _partial(interrupted: Optional[CompareInterrupted]) -> Optional[str]:
    if interrupted is None:
        return None
    if interrupted.out_of_time:
        return ("advise.budget ran out during the comparison (the machine ran slower than its calibration): its runs "
                "were stopped, and the advice holds what was measured before")
    return f"interrupted during the comparison ({interrupted}): the advice holds what was measured before"


def _with_seeds(cfg: DictConfig, seeds: int) -> DictConfig:
    if seeds == cfg.compare.seeds:
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.compare.seeds = seeds
    return out


def _inspect(advising: Advising, out_dir: Path, mode: str, relative: float = 1.0) -> int:
    """An inspection in `mode` with the steps that fit its share of what is left (inspect.steps at most), stopped
    between steps at the end of that share; none where one step does not fit (said as a note). Returns its steps."""
    cfg, run_overrides, clock, step_s = advising.cfg, advising.run_overrides, advising.clock, advising.step_s
    seconds = INSPECT_SHARE * clock.left()
    steps = inspected_steps(cfg.inspect.steps, step_s, seconds, relative)
    what = "where fp32's values fall against each format" if mode == "fp32" else \
        "what its format loses of each converted layer"
    if steps == 0:
        one_step_s = INSPECTED_STEP_COST * relative * step_s
        advising.say(f"inspect in {mode}: not run: one inspected step (~{one_step_s:.0f} s here) does not fit its "
                     f"share of the {minutes(clock.left())} left")
        advising.notes.append(
            f"inspect in {mode}: not run in advise.budget={cfg.advise.budget}: one inspected step "
            f"(~{INSPECTED_STEP_COST:.0f}x a plain one) would not fit; "
            + ("the loss-scaling modes are compared with GradScaler's own settings" if mode == "fp32" else
               "it is compared with every layer converted"))
        return 0
    advising.say(f"inspect in {mode}: {what}, {io.count_of(steps, 'step')}")
    inspect_cfg = compose_job("advise", [*run_overrides, *precision_schedule.row_overrides(mode),
                                         f"inspect.steps={steps}"])
    return run_inspect(inspect_cfg, out_dir, [*run_overrides, *precision_schedule.row_overrides(mode)],
                       clock.deadline(INSPECT_SHARE),
                       Console(quiet=True))  # what it found is advise's to say: its tables in inspect*/report.md


def _prepare(advising: Advising, plans: list[ModePlan], skipped: dict[str, str],
             gradients: Optional[GradientEvidence]) -> dict[str, Preparation]:
    """Each mode's settings before it is compared (advice.prepare): scaled modes from the fp32 inspection's
    gradients; converted modes (FP8, MX) from an inspection in that mode, which counts what their format loses
    of each converted layer (where it fits the budget). A mode not worth comparing moves to skipped."""
    cfg, run_overrides = advising.cfg, advising.run_overrides
    prepared: dict[str, Preparation] = {}
    for plan in {row_labels.parse(p.mode).mode: p for p in plans}.values():
        mode = row_labels.parse(plan.mode).mode
        mode_cfg = compose_job("advise", [*run_overrides, *precision_schedule.row_overrides(mode)])
        mode_rules = own_rules(mode_cfg)
        losses, measured_by = None, ""
        inspect_dir = advising.out_dir / f"inspect_{precision_schedule.dir_name(mode)}"
        if mode_cfg.precision.converter is not None and _inspect(advising, inspect_dir, mode, _relative_time(plan)):
            losses, measured_by = layer_losses(inspect_dir, mode)
        prepared[mode] = prepare(mode, gradients, losses, mode_rules, cfg.advise.layer_loss_limit, measured_by)
        if prepared[mode].refused is not None:
            skipped[mode] = prepared[mode].refused
    plans[:] = [p for p in plans if row_labels.parse(p.mode).mode not in skipped]
    return prepared


def _prepared_plan(plan: ModePlan, prepared: dict[str, Preparation]) -> ModePlan:
    preparation = prepared.get(row_labels.parse(plan.mode).mode)
    if preparation is None:
        return plan
    return dataclasses.replace(plan, overrides=[*plan.overrides, *preparation.overrides()])


def _machine(cfg: DictConfig) -> str:
    from ampctl.engine import devices

    device = devices.resolve_device(cfg.device.value)
    name = devices.device_name(device)
    if device.type != "cpu":
        return f"{device.type} ({name})"
    speed = cpu_speed.measured()
    return f"cpu ({name}); " + "; ".join(speed.describe())


def _calibrate(run_overrides: list[str], run_dir: Path, *extra: str) -> dict:
    """The summary of a short fp32 run of the recipe (its own record, under the advice's): the step's time here,
    the model's parameters and FLOPs; with train.compile.enabled=true, the compile time."""
    from ampctl.runner.plan import plan_run
    from ampctl.runner.run import run_training

    cfg = compose_job("train", [*run_overrides, "precision=fp32", f"train.steps={CALIBRATION_STEPS}",
                                "train.timing_warmup_steps=2", "train.console=quiet", "train.eval.every=null", *extra])
    train_log = logging.getLogger("ampctl.train")
    propagates, train_log.propagate = train_log.propagate, False  # its lines go to its own train.log only
    try:
        summary = run_training(plan_run(cfg, run_dir), echo=lambda _line: None)
    finally:
        train_log.propagate = propagates
    return summary


def _with_compile_where_it_fits(advising: Advising, plans: list[ModePlan]) -> tuple[list[ModePlan], float]:
    """The compiled plans kept where the budget leaves each run COMPILED_MIN_STEPS after compiling (its time
    measured by a compiled calibration run, taken only where the steps would fit without any compile time);
    advise.compile=true, whatever the budget. Returns the plans and the compile time."""
    cfg, clock, step_s = advising.cfg, advising.clock, advising.step_s
    forced = cfg.advise.compile is True

    def every_plan_fits(compile_s: float) -> bool:
        size = size_comparison([_candidate(p, plans) for p in plans], step_s, PLANNED_SHARE * clock.left(),
                               cfg.compare.seeds, compile_s, COMPILED_MIN_STEPS)
        return len(size.kept) == len(plans) and not size.fewer_seeds

    compile_s = None
    if forced or every_plan_fits(0.0):
        advising.say("calibration: fp32 compiled, for the compile time")
        compiled = _calibrate(advising.run_overrides, advising.out_dir / "calibration_compiled",
                              "train.compile.enabled=true")
        compile_s = float(compiled["compile_s"] or 0.0)
    if forced or (compile_s is not None and every_plan_fits(compile_s)):
        return plans, compile_s or 0.0
    cost = "" if compile_s is None else f"compiling each run (~{compile_s:.0f} s here) and "
    advising.notes.append(f"torch.compile: not measured: {cost}running every mode both ways would leave fewer "
                          f"than {COMPILED_MIN_STEPS} steps a run in advise.budget={cfg.advise.budget}; "
                          "advise.compile=true or a longer budget measures it")
    return [p for p in plans if not row_labels.parse(p.mode).compiled], 0.0


def _relative_time(plan: Any) -> float:
    if plan.device != "cpu" or plan.half is None:
        return 1.0
    return cpu_speed.measured().relative_time(plan.half)


