"""`ampctl advise`: the precision mode for this model on this machine, with the evidence.

It runs ampctl's own instruments in turn, within advise.budget, each into a directory of its own under the
advice's: inspect (a few fp32 steps with range hooks: the largest gradient, what fp16 flushes, which layers
overflow fp16); a short calibration run (the step's time, to size what follows; and a compiled one, for the
compile time, where compile is a candidate); for each FP8 or MX mode that runs at speed here (or is named in
compare.precisions) an inspection in that mode (what its format loses of each converted layer); then compare
(the candidates as they would be advised, see advice.prepare; eager and compiled where the budget leaves each run
enough steps; with and without activation checkpointing where memory is the goal) in alternating rounds over
advise's seeds: speedup with its interval, held-out parity with fp32, each mode's peak memory. Then it decides
(studies/advice.py) and writes advice.md, advice.png, advice.json and an experiment config that
`ampctl train -cd <dir> -cn <advise.name>` runs as written. Ctrl-C during the comparison leaves the advice of what
was measured, said to be partial.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from ampctl import io, run_files
from ampctl.conf.composing import compose_job, defaults_of_a_job, without_hydra_node
from ampctl.conf.schema import DEFAULT_COMPARE_PRECISIONS, budget_seconds
from ampctl.engine import cpu_speed
from ampctl.errors import UsageError
from ampctl.reports import tables
from ampctl.studies import variants
from ampctl.studies.advice import Advice, GradientEvidence, LayerLoss, ModeEvidence, Preparation, decide, prepare
from ampctl.studies.compare import CompareInterrupted, ModePlan, plan_modes, run_compare, split_overrides
from ampctl.studies.inspect_ranges import run_inspect

OWN_KEYS = ("advise.", "compare.", "inspect.")  # advise's settings: not the runs'
# the modes advise considers: those compare runs by default, and the converted formats where they run at speed
CANDIDATES = (*DEFAULT_COMPARE_PRECISIONS, "fp8", "mxfp8", "nvfp4", "mxfp4")
CALIBRATION_STEPS = 8
PROCESS_START_S = 8.0  # a mode's process: imports, build, the first steps (measured here: 5-8 s on 2 cores)
MIN_STEPS, MAX_STEPS = 30, 2000
COMPILED_MIN_STEPS = 2 * MIN_STEPS  # compile is measured only where each run keeps at least this many steps
PLANNED_SHARE = 0.9  # of the budget left: the rest for what the estimate leaves out (evaluations, reports)


def run_advise(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str]) -> None:
    console = tables.make_console()
    budget = budget_seconds(cfg.advise.budget)
    assert budget is not None  # the schema refused anything else
    clock = BudgetClock(budget)
    run_overrides = [o for o in task_overrides if not o.lstrip("+~").startswith(OWN_KEYS)]
    for override in run_overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key == "resume":
            raise UsageError(f"{override!r}: ampctl advise starts runs of its own; continue a run with ampctl train "
                             "resume=<its run dir>")
        if key == "precision" or key.startswith("precision."):
            raise UsageError(f"{override!r}: ampctl advise chooses the precision mode (from those that run at speed "
                             "here); to choose its candidates yourself, compare.precisions=[fp32,bf16,...]")
    split_overrides(run_overrides)  # refuses resume= (its runs are new ones)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"ampctl advise: goal={cfg.advise.goal.value}, budget {cfg.advise.budget} -> {out_dir}")
    facts = {"machine": _machine(cfg)}
    console.print(f"  the machine: {facts['machine']}", soft_wrap=True)

    say = lambda text: console.print(clock.line(text), soft_wrap=True, highlight=False)  # noqa: E731
    say(f"inspect: where fp32's values fall against each format, {io.count_of(cfg.inspect.steps, 'step')}")
    inspect_cfg = compose_job("advise", [*run_overrides, "precision=fp32"])
    run_inspect(inspect_cfg, out_dir / "inspect", run_overrides)
    gradients = gradient_evidence(out_dir / "inspect")

    notes: list[str] = []
    say(f"calibration: {CALIBRATION_STEPS} steps of fp32, to size the comparison to the budget")
    calibration = _calibrate(run_overrides, out_dir / "calibration")
    step_ms = float(calibration["median_step_time_ms"])
    facts["model"] = model_facts(calibration, out_dir / "inspect")
    say(f"the model: {facts['model']}")
    compile_measured = _compile_is_candidate(cfg, run_overrides, notes)
    cfg = _with_variants(cfg, run_overrides, notes, compile_measured)
    plans, skipped = plan_modes(cfg, run_overrides, CANDIDATES)
    prepared = _prepare(cfg, plans, skipped, gradients, run_overrides, out_dir, say)
    compile_s = 0.0
    if compile_measured:
        plans, compile_s = _with_compile_where_it_fits(cfg, plans, run_overrides, out_dir, step_ms,
                                                       PLANNED_SHARE * clock.left(), notes, say)
    seconds_left = PLANNED_SHARE * clock.left()
    plans = [_prepared_plan(plan, prepared) for plan in plans]
    steps, estimate = _steps_for(seconds_left, step_ms, plans, cfg, compile_s)
    plans = [dataclasses.replace(p, steps=steps, overrides=[*p.overrides, f"train.steps={steps}"]) for p in plans]
    modes = [p.mode for p in plans]
    say(f"compare {', '.join(modes)} x {io.count_of(cfg.compare.seeds, 'seed')} x {io.count_of(steps, 'step')} in "
        f"{io.count_of(cfg.compare.rounds, 'round')}: about {estimate / 60:.1f} min, done near "
        f"{time.strftime('%H:%M', time.localtime(time.time() + estimate))}")
    interrupted: Optional[CompareInterrupted] = None
    if len(plans) > 1:  # fp32 alone is no comparison
        try:
            run_compare(cfg, out_dir / "compare", [*run_overrides, f"train.steps={steps}"], config_dir,
                        planned=(plans, skipped))
        except CompareInterrupted as exc:
            interrupted = exc
    evidence = mode_evidence(out_dir / "compare", skipped, only=None if len(plans) > 1 else modes)
    advice = decide(evidence, prepared, cfg.advise.goal.value, notes)
    partial = None if interrupted is None else \
        f"interrupted during the comparison ({interrupted}): the advice holds what was measured before"
    say("the advice, from what was measured:")
    write_advice(out_dir, cfg, advice, evidence, gradients, run_overrides, console, partial, facts)
    if interrupted is not None:
        raise interrupted


class BudgetClock:
    """advise's progress against its budget: each phase's line starts `[1:05 of 10:00]`."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s, self._started = budget_s, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def line(self, text: str) -> str:
        return f"[{_minutes(self.elapsed())} of {_minutes(self.budget_s)}] {text}"


def _minutes(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 60}:{whole % 60:02d}"


def _compile_is_candidate(cfg: DictConfig, run_overrides: list[str], notes: list[str]) -> bool:
    """Whether compile is to be measured (the budget decides later where advise.compile is null)."""
    if cfg.compare.compile is not None or any(o.lstrip("+~").startswith("train.compile=") for o in run_overrides):
        notes.append("torch.compile: as set (compare.compile or train.compile), not chosen by advise")
        return False
    if cfg.advise.compile is False:
        notes.append("torch.compile: not measured (advise.compile=false)")
        return False
    return True


def _with_variants(cfg: DictConfig, run_overrides: list[str], notes: list[str], compiled_too: bool = False,
                   ) -> DictConfig:
    """The ways compare runs each mode: eager and compiled where compile is a candidate (the budget may drop the
    compiled ones later); with and without activation checkpointing where memory is the goal and the recipe names
    blocks to checkpoint, otherwise a note of why not."""
    if compiled_too:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.compare.compile = [False, True]
    if cfg.compare.activation_checkpointing is not None or any(
            o.lstrip("+~").startswith("train.activation_checkpointing=") for o in run_overrides):
        notes.append("activation checkpointing: as set (compare.activation_checkpointing or "
                     "train.activation_checkpointing), not chosen by advise")
        return cfg
    if cfg.advise.goal.value != "memory":
        notes.append("activation checkpointing: not measured: it trades compute for memory (it runs each "
                     "checkpointed block's forward twice), which goal=speed does not ask for; advise.goal=memory "
                     "measures it")
        return cfg
    from ampctl.recipes.base import build_recipe
    from ampctl.reports.plots import recipe_label

    if getattr(build_recipe(cfg.recipe), "activation_checkpoint_blocks", None) is None:
        notes.append(f"activation checkpointing: not measured: recipe {recipe_label(cfg)} names no blocks to "
                     "checkpoint")
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.compare.activation_checkpointing = [False, True]
    return out


def _prepare(cfg: DictConfig, plans: list[ModePlan], skipped: dict[str, str], gradients: Optional[GradientEvidence],
             run_overrides: list[str], out_dir: Path, say: Callable[[str], None]) -> dict[str, Preparation]:
    """Each mode's settings before it is compared (advice.prepare): scaled modes from the fp32 inspection's
    gradients; converted modes (FP8, MX) from an inspection in that mode, which counts what their format loses
    of each converted layer. A mode not worth comparing moves to skipped."""
    prepared: dict[str, Preparation] = {}
    for mode in dict.fromkeys(variants.parse(p.mode).mode for p in plans):
        mode_cfg = compose_job("advise", [*run_overrides, f"precision={mode}"])
        precision = OmegaConf.to_container(mode_cfg.precision, resolve=True, enum_to_str=True)
        own_rules = [{k: v for k, v in rule.items() if v is not None} for rule in precision.get("rules") or []]
        losses, measured_by = None, ""
        if mode_cfg.precision.converter is not None:
            inspect_dir = out_dir / f"inspect_{mode}"
            say(f"inspect in {mode}: what its format loses of each converted layer")
            run_inspect(mode_cfg, inspect_dir, [*run_overrides, f"precision={mode}"])
            losses, measured_by = layer_losses(inspect_dir, mode)
        prepared[mode] = prepare(mode, gradients, losses, own_rules, cfg.advise.layer_loss_limit, measured_by)
        if prepared[mode].refused is not None:
            skipped[mode] = prepared[mode].refused
    plans[:] = [p for p in plans if variants.parse(p.mode).mode not in skipped]
    return prepared


def _prepared_plan(plan: ModePlan, prepared: dict[str, Preparation]) -> ModePlan:
    preparation = prepared.get(variants.parse(plan.mode).mode)
    if preparation is None:
        return plan
    return dataclasses.replace(plan, overrides=[*plan.overrides, *preparation.overrides()])


def layer_losses(inspect_dir: Path, mode: str) -> tuple[Optional[list[LayerLoss]], str]:
    """Per converted layer, the operand its format loses most of (saturated + flushed), from an inspection in that
    mode: its block-scale table (MX) or its FP8 tensorwise table."""
    data = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())
    for key, measured_by in (("block_scales", f"{mode} (by its block scales)"),
                             ("fp8_tensorwise", f"{mode} (by its tensorwise scale)")):
        rows = data.get(key)
        if rows:
            return [_worst_operand(row) for row in rows], measured_by
    return None, ""


def _worst_operand(row: dict) -> LayerLoss:
    shares = {role: (row.get(f"{role}_saturated") or 0.0) + (row.get(f"{role}_flushed") or 0.0)
              for role in ("activation", "weight", "gradient")}
    role = max(shares, key=shares.__getitem__)
    return LayerLoss(row["layer"], role, shares[role])


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
    the model's parameters and FLOPs; with train.compile=true, the compile time."""
    from ampctl.runner.run import run_training

    cfg = compose_job("train", [*run_overrides, "precision=fp32", f"train.steps={CALIBRATION_STEPS}",
                                "train.timing_warmup_steps=2", "train.console=quiet", "train.eval_every=null", *extra])
    train_log = logging.getLogger("ampctl.train")
    propagates, train_log.propagate = train_log.propagate, False  # its lines go to its own train.log only
    try:
        summary = run_training(cfg, run_dir, echo=lambda _line: None)
    finally:
        train_log.propagate = propagates
    return summary


def model_facts(calibration: dict, inspect_dir: Path) -> str:
    """The model in a line: parameters and FLOPs (the calibration run's), its leaf layers by type (inspect's)."""
    rows = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())["rows"]
    types = Counter(dict((r["layer"], r.get("type", "?")) for r in rows).values())
    flops = calibration.get("model_flops_per_step")
    mfu = calibration.get("mfu")
    parameters, flop = io.si_prefixed(calibration["parameters"]), io.si_prefixed(flops or 0)
    return (f"{''.join(parameters)} parameters" + (f", {flop[0]} {flop[1]}FLOP a step" if flops else "")
            + f"; {io.count_of(sum(types.values()), 'leaf layer')} ("
            + ", ".join(f"{n} {name}" for name, n in types.most_common(4)) + (", ..." if len(types) > 4 else "")
            + f"); fp32 steps {calibration['median_step_time_ms']:.3g} ms here"
            + (f" ({mfu:.1%} MFU)" if mfu else ""))


def _with_compile_where_it_fits(cfg: DictConfig, plans: list[ModePlan], run_overrides: list[str], out_dir: Path,
                                step_ms: float, seconds_left: float, notes: list[str], say: Callable[[str], None],
                                ) -> tuple[list[ModePlan], float]:
    """The compiled plans kept where the budget leaves each run COMPILED_MIN_STEPS after compiling (its time
    measured by a compiled calibration run, taken only where the steps would fit without any compile time);
    advise.compile=true, whatever the budget. Returns the plans and the compile time."""
    both_ways = plans
    forced = cfg.advise.compile is True
    steps, _ = _steps_for(seconds_left, step_ms, both_ways, cfg)
    compile_s = None
    if steps >= COMPILED_MIN_STEPS or forced:
        started = time.monotonic()
        say("calibration: fp32 compiled, for the compile time")
        compile_s = float(_calibrate(run_overrides, out_dir / "calibration_compiled", "train.compile=true")
                          ["compile_s"] or 0.0)
        steps, _ = _steps_for(seconds_left - (time.monotonic() - started), step_ms, both_ways, cfg, compile_s)
    if steps >= COMPILED_MIN_STEPS or forced:
        return both_ways, compile_s or 0.0
    cost = "" if compile_s is None else f"compiling each run (~{compile_s:.0f} s here) and "
    notes.append(f"torch.compile: not measured: {cost}running every mode both ways would leave "
                 f"{io.count_of(steps, 'step')} a run in advise.budget={cfg.advise.budget}, under {COMPILED_MIN_STEPS}; "
                 "advise.compile=true or a longer budget measures it")
    return [p for p in plans if not variants.parse(p.mode).compiled], 0.0


def _steps_for(seconds_left: float, step_ms: float, plans: list, cfg: DictConfig,
               compile_s: float = 0.0) -> tuple[int, float]:
    """The steps each mode's run takes so that the comparison fits what is left of the budget, and the estimate.
    A mode's step is fp32's times the CPU probe's slowdown of its half type (a GPU's modes are taken as fp32's);
    a compiled run adds its compile time once."""
    slowdown = sum(_relative_time(plan) for plan in plans)
    seeds = cfg.compare.seeds
    per_step_s = seeds * slowdown * step_ms / 1e3
    compiled = sum(variants.parse(plan.mode).compiled for plan in plans)
    fixed_s = seeds * (len(plans) * PROCESS_START_S + compiled * compile_s)
    steps = int(max(seconds_left - fixed_s, 0) / per_step_s) if per_step_s > 0 else MAX_STEPS
    steps = max(MIN_STEPS, min(MAX_STEPS, steps))
    return steps, fixed_s + steps * per_step_s


def _relative_time(plan: Any) -> float:
    if plan.device != "cpu" or plan.half is None:
        return 1.0
    return cpu_speed.measured().relative_time(plan.half)


def gradient_evidence(inspect_dir: Path) -> Optional[GradientEvidence]:
    """From ranges.json: the largest true gradient, what fp16 flushes at 2^16, the layers whose activations
    exceed fp16's range."""
    data = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())
    summary = {row["kind"]: row for row in data["summary"]}
    grads = [summary[k]["max_abs"] for k in ("activation_grad", "weight_grad") if k in summary]
    if not grads:
        return None
    overflowing = tuple(dict.fromkeys(r["layer"] for r in data["rows"]
                                      if r["kind"] == "activation" and (r.get("fp16_overflow") or 0) > 0))
    flushed = summary.get("activation_grad", {}).get("fp16_to_zero_scaled") or 0.0
    return GradientEvidence(max(grads), flushed, overflowing)


def mode_evidence(compare_dir: Path, skipped: dict[str, str], only: Optional[list[str]] = None) -> list[ModeEvidence]:
    """Every mode's row of comparison.json, and the modes compare did not run (with its reason)."""
    evidence = [ModeEvidence(mode, skipped=reason) for mode, reason in skipped.items()]
    record = compare_dir / f"{run_files.COMPARISON}.json"
    if only is not None or not record.is_file():
        return [*(ModeEvidence(mode, 1.0, 1.0, 1.0) for mode in (only or [])), *evidence]
    data = json.loads(record.read_text())
    skipped_there = {mode: reason for mode, reason in data.get("skipped", {}).items() if mode not in skipped}
    evidence += [ModeEvidence(mode, skipped=reason) for mode, reason in skipped_there.items()]
    for row in data["rows"]:
        if row["precision"] in skipped or row["precision"] in skipped_there:
            continue
        if row.get("status") != "ok":
            evidence.append(ModeEvidence(row["precision"], failed=str(row.get("status"))))
            continue
        evidence.append(ModeEvidence(
            row["precision"], row.get("speedup"), row.get("speedup_low"), row.get("speedup_high"), row.get("parity"),
            row.get("eval_loss_delta"), row.get("eval_loss_delta_interval"), row.get("seeds") or 0,
            row.get("peak_memory_mib")))
    return evidence


def write_advice(out_dir: Path, cfg: DictConfig, advice: Advice, evidence: list[ModeEvidence],
                 gradients: Optional[GradientEvidence], run_overrides: list[str], console: Any,
                 partial: Optional[str], facts: dict[str, str]) -> None:
    """advice.json (the advice and its evidence), advice.md, and the experiment config that runs the advice."""
    config = out_dir / f"{cfg.advise.name}.yaml"
    job = compose_job("train", [*run_overrides, *advice.overrides()], with_hydra=True)
    io.atomic_write_text(config, defaults_of_a_job("train", dict(job.hydra.runtime.choices))
                         + OmegaConf.to_yaml(without_hydra_node(job)))
    record = {"kind": "advise", "advice": advice.to_json(), "partial": partial,
              "evidence": [vars(e) for e in evidence],
              "gradients": None if gradients is None else vars(gradients),
              "overrides": run_overrides, "config": config.name, "facts": facts}
    io.write_json(out_dir / f"{run_files.ADVICE}.json", record)
    say_advice(out_dir, advice, evidence, partial, config, console, facts)


def say_advice(out_dir: Path, advice: Advice, evidence: list[ModeEvidence], partial: Optional[str], config: Path,
               console: Any, facts: dict[str, str]) -> None:
    """advice.md (the machine and the model, then the advice, with its plot where modes were compared), and the
    advice's lines on the console (which said the machine and the model as it measured them)."""
    lines = advice_lines(advice, partial, config, out_dir)
    image = speed_plot(out_dir, advice, evidence)
    header = "".join(f"{what}: {text}\n\n" for what, text in facts.items())
    io.atomic_write_text(out_dir / f"{run_files.ADVICE}.md", "# ampctl advise\n\n" + header + "\n".join(
        f"- {line}" if i else line for i, line in enumerate(lines)) + "\n"
        + (f"\n![{image.stem}]({image.name})\n" if image is not None else ""))
    for line in lines:
        console.print(line, soft_wrap=True)


def speed_plot(out_dir: Path, advice: Advice, evidence: list[ModeEvidence]) -> Optional[Path]:
    from ampctl.reports import plots

    points = [{"mode": e.mode, "speedup": e.speedup, "speedup_low": e.speedup_low, "speedup_high": e.speedup_high,
               "delta": e.eval_loss_delta, "delta_interval": e.eval_loss_delta_interval}
              for e in evidence if e.speedup is not None and e.skipped is None and e.failed is None]
    if len(points) < 2:
        return None
    return plots.speed_and_accuracy(points, advice.mode, out_dir / "advice.png",
                                    f"ampctl advise (goal={advice.goal}): {' '.join(advice.overrides())}")


def rerender(out_dir: Path, console: Any) -> None:
    """`ampctl report` on an advice's directory: advice.md, its plot and its lines again, from advice.json."""
    record = json.loads((out_dir / f"{run_files.ADVICE}.json").read_text())
    evidence = [ModeEvidence(**e) for e in record["evidence"]]
    say_advice(out_dir, Advice(**record["advice"]), evidence, record.get("partial"), out_dir / record["config"],
               console, record.get("facts", {}))


def advice_lines(advice: Advice, partial: Optional[str], config: Path, out_dir: Path) -> list[str]:
    lines = [f"advice (goal={advice.goal}): precision={advice.precision}"
             + (f" with {' '.join(advice.overrides()[1:])}" if len(advice.overrides()) > 1 else "")]
    if partial:
        lines.append(f"partial: {partial}")
    lines += [f"why: {reason}" for reason in advice.reasons]
    lines += [f"not {mode}: {why}" for mode, why in advice.rejected.items()]
    lines += [f"note: {note}" for note in advice.notes]
    lines.append(f"run it: ampctl train -cd {out_dir} -cn {config.stem}   (the evidence: inspect/, compare/, "
                 "advice.json, advice.png)")
    return lines
