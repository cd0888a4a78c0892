"""`ampctl advise`: the precision mode for this model on this machine, with the evidence.

It runs ampctl's own instruments in turn, within advise.budget, each into a directory of its own under the
advice's: inspect (a few fp32 steps with range hooks: the largest gradient, what fp16 flushes, which layers
overflow fp16), a short calibration run (the step's time, to size what follows), and compare (the modes that
run at speed here, in alternating rounds, over advise's seeds: speedup with its interval, held-out parity with
fp32, each mode's peak memory). Then it decides (studies/advice.py) and writes advice.md, advice.json and an
experiment config that `ampctl train -cd <dir> -cn <advise.name>` runs as written. Ctrl-C during the comparison
leaves the advice of what was measured, said to be partial.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files
from ampctl.conf.composing import compose_job, defaults_of_a_job, without_hydra_node
from ampctl.conf.schema import budget_seconds
from ampctl.engine import cpu_speed
from ampctl.errors import UsageError
from ampctl.reports import tables
from ampctl.studies.advice import Advice, GradientEvidence, ModeEvidence, decide
from ampctl.studies.compare import CompareInterrupted, plan_modes, run_compare, split_overrides
from ampctl.studies.inspect_ranges import run_inspect

OWN_KEYS = ("advise.", "compare.", "inspect.")  # advise's settings: not the runs'
CALIBRATION_STEPS = 8
PROCESS_START_S = 8.0  # a mode's process: imports, build, the first steps (measured here: 5-8 s on 2 cores)
MIN_STEPS, MAX_STEPS = 30, 2000


def run_advise(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str]) -> None:
    console = tables.make_console()
    budget = budget_seconds(cfg.advise.budget)
    assert budget is not None  # the schema refused anything else
    started = time.monotonic()
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
    console.print(f"  the machine: {_machine(cfg)}", soft_wrap=True)

    inspect_cfg = compose_job("advise", [*run_overrides, "precision=fp32"])
    run_inspect(inspect_cfg, out_dir / "inspect", run_overrides)
    gradients = gradient_evidence(out_dir / "inspect")

    step_ms = _calibrate(run_overrides, out_dir / "calibration")
    plans, skipped = plan_modes(cfg, run_overrides)
    steps, estimate = _steps_for(budget - (time.monotonic() - started), step_ms, plans, cfg)
    modes = [p.mode for p in plans]
    console.print(f"  plan: compare {', '.join(modes)} x {io.count_of(cfg.compare.seeds, 'seed')} x "
                  f"{io.count_of(steps, 'step')} in {io.count_of(cfg.compare.rounds, 'round')} (about "
                  f"{estimate / 60:.1f} min; fp32 steps {step_ms:.1f} ms here)", soft_wrap=True)
    interrupted: Optional[CompareInterrupted] = None
    if len(plans) > 1:  # fp32 alone is no comparison
        try:
            run_compare(cfg, out_dir / "compare", [*run_overrides, f"train.steps={steps}"], config_dir)
        except CompareInterrupted as exc:
            interrupted = exc
    evidence = mode_evidence(out_dir / "compare", skipped, only=None if len(plans) > 1 else modes)
    advice = decide(evidence, gradients, cfg.advise.goal.value)
    partial = None if interrupted is None else \
        f"interrupted during the comparison ({interrupted}): the advice holds what was measured before"
    write_advice(out_dir, cfg, advice, evidence, gradients, run_overrides, console, partial)
    if interrupted is not None:
        raise interrupted


def _machine(cfg: DictConfig) -> str:
    from ampctl.engine import devices

    device = devices.resolve_device(cfg.device.value)
    name = devices.device_name(device)
    if device.type != "cpu":
        return f"{device.type} ({name})"
    speed = cpu_speed.measured()
    return f"cpu ({name}); " + "; ".join(speed.describe())


def _calibrate(run_overrides: list[str], run_dir: Path) -> float:
    """fp32's median step time here, from a short run of the recipe (its own record, under the advice's)."""
    from ampctl.runner.run import run_training

    cfg = compose_job("train", [*run_overrides, "precision=fp32", f"train.steps={CALIBRATION_STEPS}",
                                "train.timing_warmup_steps=2", "train.console=quiet", "train.eval_every=null"])
    summary = run_training(cfg, run_dir, echo=lambda _line: None)
    return float(summary["median_step_time_ms"])


def _steps_for(seconds_left: float, step_ms: float, plans: list, cfg: DictConfig) -> tuple[int, float]:
    """The steps each mode's run takes so that the comparison fits what is left of the budget, and the estimate.
    A mode's step is fp32's times the CPU probe's slowdown of its half type (a GPU's modes are taken as fp32's)."""
    slowdown = sum(_relative_time(plan) for plan in plans)
    seeds = cfg.compare.seeds
    per_step_s = seeds * slowdown * step_ms / 1e3
    fixed_s = seeds * len(plans) * PROCESS_START_S
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
            row.get("eval_loss_delta"), row.get("seeds") or 0, row.get("peak_memory_mib")))
    return evidence


def write_advice(out_dir: Path, cfg: DictConfig, advice: Advice, evidence: list[ModeEvidence],
                 gradients: Optional[GradientEvidence], run_overrides: list[str], console: Any,
                 partial: Optional[str]) -> None:
    """advice.json (the advice and its evidence), advice.md, and the experiment config that runs the advice."""
    config = out_dir / f"{cfg.advise.name}.yaml"
    job = compose_job("train", [*run_overrides, *advice.overrides()], with_hydra=True)
    io.atomic_write_text(config, defaults_of_a_job("train", dict(job.hydra.runtime.choices))
                         + OmegaConf.to_yaml(without_hydra_node(job)))
    record = {"kind": "advise", "advice": advice.to_json(), "partial": partial,
              "evidence": [vars(e) for e in evidence],
              "gradients": None if gradients is None else vars(gradients),
              "overrides": run_overrides, "config": config.name}
    io.write_json(out_dir / f"{run_files.ADVICE}.json", record)
    say_advice(out_dir, advice, partial, config, console)


def say_advice(out_dir: Path, advice: Advice, partial: Optional[str], config: Path, console: Any) -> None:
    """advice.md, and the same lines on the console."""
    lines = advice_lines(advice, partial, config, out_dir)
    io.atomic_write_text(out_dir / f"{run_files.ADVICE}.md", "# ampctl advise\n\n" + "\n".join(
        f"- {line}" if i else line for i, line in enumerate(lines)) + "\n")
    for line in lines:
        console.print(line, soft_wrap=True)


def rerender(out_dir: Path, console: Any) -> None:
    """`ampctl report` on an advice's directory: advice.md and its lines again, from advice.json."""
    record = json.loads((out_dir / f"{run_files.ADVICE}.json").read_text())
    say_advice(out_dir, Advice(**record["advice"]), record.get("partial"), out_dir / record["config"], console)


def advice_lines(advice: Advice, partial: Optional[str], config: Path, out_dir: Path) -> list[str]:
    lines = [f"advice (goal={advice.goal}): precision={advice.mode}"
             + (f" with {' '.join(advice.overrides()[1:])}" if len(advice.overrides()) > 1 else "")]
    if partial:
        lines.append(f"partial: {partial}")
    lines += [f"why: {reason}" for reason in advice.reasons]
    lines += [f"not {mode}: {why}" for mode, why in advice.rejected.items()]
    lines.append(f"run it: ampctl train -cd {out_dir} -cn {config.stem}   (the evidence: inspect/, compare/, "
                 "advice.json)")
    return lines


