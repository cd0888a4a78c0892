"""`ampctl memory`: the memory model of a run next to its measured peak, per precision mode.

For each mode (and with or without activation checkpointing), in this process one after the other: build
the model, optimizer and scaler as `ampctl train` would, run memory.steps training steps inside the peak
measurement (the first step allocates the optimizer's state), time a few more steps, then count the
activations of one forward. With memory.budget, the activations are counted at a second batch size too and
the largest batch that fits is estimated, then, on CUDA, found by a search of real steps, each probe in a
process of its own.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ampctl import io, run_files
from ampctl.analysis.memory.measure import MeasuredPeak, measure_peak, release_memory
from ampctl.analysis.memory.model import (
    ActivationLine,
    ModelPart,
    ModelStateBytes,
    SavedTensorCounter,
    estimate_model_states,
    largest_batch,
    parse_size,
    states_by_part,
)
from ampctl.conf.composing import compose_job
from ampctl.engine.activation_checkpointing import require_checkpoint_blocks
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, StepsHooks, batch_stream, run_steps
from ampctl.errors import UsageError
from ampctl.preloaded import PreloadedProcess
from ampctl.processes import child_environment
from ampctl.recipes.base import build_recipe
from ampctl.reports import plots, tables
from ampctl.reports.progress import Phases
from ampctl.runner.plan import check_config
from ampctl.studies import row_labels

SEARCH_PROBES = 10  # real-step probes of the batch search, at most


class ProbeFailed(Exception):
    """A probe of the batch search ended in an error other than running out of device memory."""


@dataclass
class ModeMemory:
    label: str
    states: ModelStateBytes
    activations: int  # saved for backward by one forward at the configured batch
    peak: MeasuredPeak
    step_time_ms: Optional[float]
    batch_size: Optional[int]
    activation_line: Optional[ActivationLine] = None
    batch_estimate: Optional[int] = None
    batch_found: Optional[int] = None
    search_log: list[str] = field(default_factory=list)
    emulated: bool = False  # an emulated format: fp32 weights and matmuls, not the format's bytes or speed
    # a mixture of experts' model states per part (experts, routers, the rest): they add up to `states`
    parts: list[ModelPart] = field(default_factory=list)

    @property
    def estimate(self) -> Optional[int]:
        return None if self.states.total is None else self.states.total + self.activations


def plan(cfg: DictConfig, task_overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(row label, overrides of its train config) for every mode and checkpointing choice."""
    run_overrides = [o for o in task_overrides if not o.lstrip("+~").startswith("memory.")]
    names = [cfg.precision.name] if cfg.memory.precisions is None else list(cfg.memory.precisions)
    if cfg.memory.precisions is not None:
        given = [o for o in run_overrides if o.lstrip("+~").split("=", 1)[0].split(".")[0] == "precision"]
        if given:
            raise UsageError(f"{given[0]!r}: give the modes with memory.precisions=[...] or one precision=, not both")
    checkpointing = ([cfg.train.activation_checkpointing] if cfg.memory.activation_checkpointing is None
                     else list(cfg.memory.activation_checkpointing))
    rows = []
    for name in names:
        for ac in checkpointing:
            label = row_labels.label(name, False, ac, both_compiled=False, both_checkpointed=len(checkpointing) > 1)
            ac_override = f"train.activation_checkpointing={str(ac).lower()}"
            rows.append((label, [*run_overrides, f"precision={name}", ac_override]))
    return rows


def _steps(state, recipe, batches: Iterator[Any], policy, cfg: DictConfig, n: int,
           after_step: Callable[[int], None]) -> list[float]:
    return run_steps(state, batches, n, recipe, policy, StepSettings.of(cfg.train), StepsHooks(after_step=after_step),
                     timed=True)


def _warm_up(cfg: DictConfig, policy, recipe, steps: int) -> None:
    """A build and the measured number of steps, thrown away, so that what happens once per process happens
    outside the measurement and the measured steps are steps like any other: torchao's optimizers and
    train.compile compile their code on the first step (under the memory profiler, which records every op of a
    compile, adamw_8bit on a 0.15M-parameter MLP grew past 22 GB), oneDNN picks its kernels. The compiled code
    is cached by the shapes and dtypes it saw, which the measured build repeats."""
    state = build_state(cfg, policy, recipe)
    run_steps(state, batch_stream(recipe, policy.device, cfg.train.seed), steps, recipe, policy,
              StepSettings.of(cfg.train))
    del state
    release_memory(policy.device)


def _recipe_with_batch(cfg: DictConfig, batch_size: int):
    recipe_cfg = OmegaConf.to_container(cfg.recipe, resolve=True)
    recipe_cfg["batch_size"] = batch_size
    return build_recipe(OmegaConf.create(recipe_cfg))


def _checkpointed_blocks(cfg: DictConfig, recipe: Any, model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(recipe.activation_checkpoint_blocks(model)) if cfg.train.activation_checkpointing else []


def _count_activations(state, recipe, policy, cfg: DictConfig) -> int:
    counter = SavedTensorCounter(state.model)
    batch = next(recipe.batches(policy.device, cfg.train.seed))
    with counter.counting(_checkpointed_blocks(cfg, recipe, state.model)), policy.forward_context():
        loss = recipe.loss(state.model, batch)
    del loss
    return counter.bytes


def measure_mode(label: str, cfg: DictConfig, budget: Optional[int], settings: DictConfig,
                 phase: Callable[[str], None] = lambda what: None) -> ModeMemory:
    """One mode's memory: the peak measured over its build and settings.steps steps, the estimate per part,
    settings.timed_steps timed steps (settings: the command's memory node; a mode's own config has the
    defaults there). phase(what) after each part (progress)."""
    policy = check_config(cfg)
    recipe = build_recipe(cfg.recipe)
    batch_size = cfg.recipe.get("batch_size") if isinstance(cfg.recipe.get("batch_size"), int) else None
    if budget is not None and batch_size is None:
        raise UsageError("memory.budget needs a recipe with an integer recipe.batch_size to vary")
    with policy:
        _warm_up(cfg, policy, recipe, settings.steps)
        phase(f"warmed up: a build and {settings.steps} steps, not measured")
        with measure_peak(policy.device, by_category=True) as peak:
            state = build_state(cfg, policy, recipe)
            batches = batch_stream(recipe, policy.device, cfg.train.seed)
            phase("built the model")
            n = settings.steps
            _steps(state, recipe, batches, policy, cfg, n, lambda done: phase(f"measured step {done}/{n}"))
        if policy.device.type == "cpu":  # the profiler's timeline is read when the measurement ends
            phase("read the CPU memory timeline of the build and the measured steps")
        accumulation = state.weights.accumulation
        states = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer,
                                       weight_average=state.ema is not None,
                                       grad_accumulators=accumulation.buffer_bytes if accumulation else 0)
        parts = states_by_part(state.model, state.weights.optimizer_params, cfg.optimizer, state.ema is not None,
                               accumulation.buffers if accumulation else None)
        n = settings.timed_steps
        times = _steps(state, recipe, batches, policy, cfg, n, lambda done: phase(f"timed step {done}/{n}"))
        # Counted after the measurement, so that the counting (and its recomputation of a checkpointed
        # block) is never part of the measured peak.
        activations = _count_activations(state, recipe, policy, cfg)
        result = ModeMemory(label, states, activations, peak, statistics.median(times) if times else None, batch_size,
                            emulated=policy.emulated, parts=parts)
        if budget is not None:
            other = max(1, batch_size // 2) if batch_size > 1 else 2
            other_bytes = _count_activations(state, _recipe_with_batch(cfg, other), policy, cfg)
            result.activation_line = ActivationLine.through(batch_size, activations, other, other_bytes)
            if states.total is not None:
                result.batch_estimate = largest_batch(budget, states.total, result.activation_line)
        del state, batches
        release_memory(policy.device)
    return result


def find_batch(result: ModeMemory, overrides: list[str], config_dir: Optional[str], budget: int) -> None:
    """The batch search for one row, each probe in its own process, after every row is measured."""
    try:
        result.batch_found = search_batch(overrides, config_dir, budget, result.batch_estimate or result.batch_size,
                                          result.search_log)
    except ProbeFailed as exc:
        result.search_log.append(f"search stopped: a probe failed: {exc}")


def _fits(overrides: list[str], config_dir: Optional[str], batch_size: int, budget: int) -> tuple[bool, Optional[int]]:
    """Two real steps at this batch size, in a fresh process: does the peak stay within the budget (and
    the device)? Returns (fits, measured peak or None when out of device memory)."""
    command = [sys.executable, "-m", "ampctl.studies.memory_probe", str(batch_size),
               *(["--config-dir", config_dir] if config_dir else []), *overrides]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        returncode = PreloadedProcess(command, env=child_environment(), stdout=out.fileno(),
                                      stderr=err.fileno()).wait()
        stdout, stderr = (_read(stream) for stream in (out, err))
    lines = stdout.strip().splitlines()
    if returncode != 0 or not lines:
        errors = [line for line in stderr.splitlines() if line.strip()]
        raise ProbeFailed(errors[-1] if errors else f"exit code {returncode}")
    answer = json.loads(lines[-1])
    if answer.get("out_of_memory"):
        return False, None
    return answer["peak"] <= budget, answer["peak"]


def _read(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read().decode(errors="replace")


def search_batch(overrides: list[str], config_dir: Optional[str], budget: int, start: int, log: list[str]) -> int:
    """The largest batch whose measured peak fits: double from the estimate until one does not fit, then
    bisect. Stops after SEARCH_PROBES probes with the largest batch seen to fit."""
    fitting, failing = 0, None  # the largest batch known to fit, the smallest known not to
    candidate = max(1, start)
    for _ in range(SEARCH_PROBES):
        fits, peak = _fits(overrides, config_dir, candidate, budget)
        log.append(f"batch {candidate}: " + ("fits" if fits else "does not fit") +
                   (f" (peak {io.format_bytes(peak)})" if peak is not None else " (out of device memory)"))
        if fits:
            fitting = candidate
        else:
            failing = candidate
        if failing is not None and failing - fitting <= 1:
            return fitting
        candidate = candidate * 2 if failing is None else (fitting + failing) // 2
    log.append(f"search stopped after {SEARCH_PROBES} probes: at least {fitting}")
    return fitting


# --- the table ------------------------------------------------------------------------------------------


def memory_table(rows: list[ModeMemory], budget: Optional[int], budget_text: Optional[str]) -> tables.ReportTable:
    # byte counts, their unit in the column name (memory.csv holds numbers only); shorter headers on screen
    sizes = {"weights_bytes": "weights", "gradients_bytes": "grads", "master_weights_bytes": "masters",
             "optimizer_states_bytes": "optimizer", "weight_average_bytes": "EMA",
             "grad_accumulators_bytes": "fp32 accum", "activations_bytes": "activations",
             "estimate_bytes": "estimate", "measured_peak_bytes": "peak", "difference_bytes": "peak − est."}
    if not any(r.states.weight_average for r in rows):  # a column only where train.ema.decay keeps an average
        del sizes["weight_average_bytes"]
    if not any(r.states.grad_accumulators for r in rows):  # and where precision.grad_accum_dtype keeps buffers
        del sizes["grad_accumulators_bytes"]
    columns = ["precision", *sizes, "step_time_ms"]
    if budget is not None:
        columns += ["batch_estimate", "batch_found"]
    table_rows = []
    for r in rows:
        s = r.states
        values = {
            "precision": r.label, "weights_bytes": s.weights, "gradients_bytes": s.gradients,
            "master_weights_bytes": s.master_weights, "optimizer_states_bytes": s.optimizer_states,
            "weight_average_bytes": s.weight_average, "grad_accumulators_bytes": s.grad_accumulators,
            "activations_bytes": r.activations,
            "estimate_bytes": r.estimate, "measured_peak_bytes": r.peak.bytes,
            "difference_bytes": None if r.estimate is None or r.peak.bytes is None else r.peak.bytes - r.estimate,
            "step_time_ms": r.step_time_ms, "batch_estimate": r.batch_estimate, "batch_found": r.batch_found,
        }
        table_rows.append([values[c] for c in columns])
    headers = {"precision": "mode", **sizes, "step_time_ms": "step ms", "batch_estimate": "batch (est.)",
               "batch_found": "batch (found)"}
    formats = {**{c: lambda v: io.format_bytes(v, 1) for c in sizes if c != "difference_bytes"},
               "difference_bytes": lambda v: ("+" if v >= 0 else "−") + io.format_bytes(abs(v), 1),
               "step_time_ms": lambda v: f"{v:,.1f}"}
    title = "memory per precision mode" + (f" (budget {budget_text})" if budget is not None else "")
    # a terminal too narrow for every column shows the states' sum in one (each in report.md and memory.csv)
    held = [c for c in sizes if c not in ("activations_bytes", "estimate_bytes", "measured_peak_bytes",
                                          "difference_bytes")]
    screen = ["precision", "states", "activations_bytes", "estimate_bytes", "measured_peak_bytes", "difference_bytes",
              "step_time_ms", *columns[len(sizes) + 2:]]
    states = {"states": lambda row: io.format_bytes(sum(row[c] or 0 for c in held), 1)}
    return tables.ReportTable(title, columns, table_rows, notes=memory_notes(rows, budget),
                              headers={**headers, "states": "states"},
                              formats=formats, cells=states, screen=screen, screen_when_narrow=True,
                              screen_note=f"states = {' + '.join(sizes[c] for c in held)}: each in report.md and "
                                          "memory.csv")


PARTS_TITLE = "model states per part of the mixture of experts"


def parts_table(rows: list[ModeMemory]) -> Optional[tables.ReportTable]:
    """Each mode's model states split between the experts, the routers and the rest (a model without experts: none),
    counted as the whole's are: the parts add up to the mode's row of the memory table."""
    if not any(r.parts for r in rows):
        return None
    sizes = {"weights": "weights", "gradients": "grads", "master_weights": "masters",
             "optimizer_states": "optimizer", "weight_average": "EMA", "grad_accumulators": "fp32 accum"}
    for attr in ("weight_average", "grad_accumulators"):  # a column only where a mode keeps them
        if not any(getattr(part.states, attr) for r in rows for part in r.parts):
            del sizes[attr]
    columns = ["precision", "part", "parameters", *(f"{attr}_bytes" for attr in sizes), "states_bytes", "share"]
    table_rows = []
    for r in rows:
        for part in r.parts:
            total = part.states.total
            table_rows.append([r.label, part.name, part.parameters, *(getattr(part.states, a) for a in sizes), total,
                               None if total is None or not r.states.total else total / r.states.total])
    headers = {"precision": "mode", **{f"{a}_bytes": h for a, h in sizes.items()}, "states_bytes": "states",
               "share": "of states"}
    formats = {**{f"{a}_bytes": lambda v: io.format_bytes(v, 1) for a in sizes},
               "states_bytes": lambda v: io.format_bytes(v, 1), "parameters": lambda v: f"{v:,}",
               "share": lambda v: f"{v:.1%}"}
    return tables.ReportTable(PARTS_TITLE, columns, table_rows, headers=headers, formats=formats,
                              screen=["precision", "part", "parameters", "states_bytes", "share"],
                              screen_when_narrow=True,
                              screen_note=f"states = {' + '.join(sizes.values())}: each in report.md and memory.csv",
                              notes=[
        "every expert's weights, gradients and optimizer states are held, though each token computes with its "
        "router's top-k of them (FLOPs count those: ampctl train's MFU); routers: their gates."])


def memory_notes(rows: list[ModeMemory], budget: Optional[int]) -> list[str]:
    ema = " + EMA (train.ema.decay's fp32 average of the weights)" if any(r.states.weight_average for r in rows) else ""
    if any(r.states.grad_accumulators for r in rows):
        ema += " + fp32 accum (precision.grad_accum_dtype=float32's gradient buffers, 4 bytes a half weight)"
    notes = [f"estimate = weights + grads + masters (O2's fp32 master weights) + optimizer states{ema} + activations "
             "(the bytes autograd saves in one forward, autocast's half weight copies included). grads: the most "
             "gradient memory alive at once; under O2 the fp32 master gradients replace the half ones as they are "
             "made, so the larger set counts, not both."]
    source = rows[0].peak.source if rows else ""
    if source.startswith("torch.cuda"):
        notes.append("measured peak = torch.cuda.max_memory_allocated (tensors only). The caching allocator "
                     "reserved more: " + ", ".join(f"{r.label} {io.format_bytes(r.peak.reserved)}" for r in rows) +
                     "; the CUDA context and cuBLAS/cuDNN workspaces are outside both.")
    elif source:
        notes.append(f"measured peak = {source}: tensor memory of the process, the interpreter not included.")
    notes += [f"{r.label} is emulated: its bytes and step time are the emulation's (fp32 weights and matmuls, with "
              "quantized copies of each operand on top), not the format's." for r in rows if r.emulated]
    for r in rows:
        if r.peak.breakdown:
            parts = ", ".join(f"{k.replace('_', ' ')} {io.format_bytes(v)}" for k, v in r.peak.breakdown.items())
            notes.append(f"{r.label} at its peak: {parts}.")
    notes.append("Why the peak differs from the estimate: gradients are freed after each step (set_to_none) and "
                 "activations are freed as backward consumes them, so not all of both are alive at once "
                 "(measured < estimate); temporaries (attention and softmax buffers, the logits and the loss, "
                 "clipping and the fused optimizer's scratch) come on top (measured > estimate).")
    if budget is not None:
        notes.append("max batch (est.) = (budget − model states − fixed activations) / activations per sample, "
                     "from counts at two batch sizes; max batch (found): largest batch whose two real steps "
                     "stayed within the budget (CUDA only).")
    return notes


def run_memory(cfg: DictConfig, out_dir: Path, task_overrides: list[str], config_dir: Optional[str]) -> None:
    budget = None if cfg.memory.budget is None else parse_size(cfg.memory.budget)
    rows = plan(cfg, task_overrides)
    configs = [(label, compose_job("memory", overrides)) for label, overrides in rows]
    for _, mode_cfg in configs:
        check_config(mode_cfg)  # refuse what cannot run before measuring anything
    if any(mode_cfg.train.activation_checkpointing for _, mode_cfg in configs):
        recipe = build_recipe(configs[0][1].recipe)
        require_checkpoint_blocks(recipe, type(recipe).__name__)
    device = check_config(configs[0][1]).device
    search = device.type == "cuda" if cfg.memory.search is None else bool(cfg.memory.search)
    if search and device.type != "cuda":
        raise UsageError("memory.search=true needs a CUDA device: on a CPU the batch is estimated only")
    console = tables.make_console()
    console.print(f"ampctl memory: {', '.join(label for label, _ in configs)}; {cfg.memory.steps} measured "
                  f"steps each -> {out_dir}")
    results = []
    for i, (label, mode_cfg) in enumerate(configs, 1):
        console.print(f"[{i}/{len(configs)}] {label}: measuring")
        results.append(measure_mode(label, mode_cfg, budget, cfg.memory, Phases(console)))
    if budget is not None and search:
        for i, (result, (label, overrides)) in enumerate(zip(results, rows), 1):
            console.print(f"[{i}/{len(rows)}] {label}: searching the largest batch within {cfg.memory.budget}")
            find_batch(result, overrides, config_dir, budget)
            for line in result.search_log:
                console.print(f"    {line}")
    machine = tables.machine_info([{"device": device.type, "device_name": _device_name(device)}])
    context = (f"recipe={plots.recipe_label(cfg)} · batch {cfg.recipe.get('batch_size', '?')} · {device.type} "
               f"({_device_name(device)})")
    write_memory_report(out_dir, results, cfg.memory.budget, machine, task_overrides, console, context)


# the stacked bars of memory.png: each part of the estimate, from ModelStateBytes (None: the activations)
MEMORY_PARTS = (("weights", "weights"), ("gradients", "gradients"), ("fp32 masters", "master_weights"),
                ("optimizer states", "optimizer_states"), ("fp32 EMA", "weight_average"),
                ("fp32 grad accum", "grad_accumulators"), ("activations", None))


def write_memory_report(out_dir: Path, results: list[ModeMemory], budget_text: Optional[str], machine: dict,
                        overrides: list[str], console: Console, context: str = "") -> None:
    """memory.csv, memory.json (everything needed to render it again) and report.md; the table printed."""
    budget = None if budget_text is None else parse_size(budget_text)
    table = memory_table(results, budget, budget_text)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = {"kind": "memory", "overrides": overrides, "budget": budget_text, "budget_bytes": budget,
             "modes": [_mode_record(r) for r in results]}
    image = plots.memory_bars([r.label for r in results],
                              {part: [getattr(r.states, attr) if attr else r.activations for r in results]
                               for part, attr in MEMORY_PARTS},
                              [r.peak.bytes for r in results], out_dir / "memory.png", context)
    parts = parts_table(results)
    also = [parts] if parts is not None else []
    files = tables.write_files(table, out_dir, run_files.MEMORY, machine, [image], {**extra, "context": context}, also)
    tables.print_table(table, console)
    for extra_table in also:
        tables.print_table(extra_table, console)
    console.print(tables.wrote([*files, image], out_dir))


def rerender(out_dir: Path, console: Console) -> None:
    """`ampctl report` on a memory directory: the table again from memory.json."""
    data = json.loads((out_dir / f"{run_files.MEMORY}.json").read_text())
    if any("master_gradients" in m["model_states"] for m in data["modes"]):
        raise UsageError(f"{out_dir / 'memory.json'} was written by an older ampctl memory (it counted O2's half and "
                         "fp32 gradients both); run ampctl memory again")
    write_memory_report(out_dir, [_from_record(m) for m in data["modes"]], data.get("budget"), data["machine"],
                        data.get("overrides", []), console, data.get("context", ""))


def _device_name(device: torch.device) -> str:
    from ampctl.engine import devices

    return devices.device_name(device)


def _mode_record(r: ModeMemory) -> dict[str, Any]:
    return {
        "precision": r.label, "model_states": r.states.as_dict(), "activations": r.activations,
        "estimate": r.estimate, "measured_peak": r.peak.bytes, "measured_source": r.peak.source,
        "measured_breakdown": r.peak.breakdown, "peak_reserved": r.peak.reserved, "step_time_ms": r.step_time_ms,
        "batch_size": r.batch_size,
        "activations_per_sample": None if r.activation_line is None else r.activation_line.per_sample,
        "activations_fixed": None if r.activation_line is None else r.activation_line.fixed,
        "batch_estimate": r.batch_estimate, "batch_found": r.batch_found, "search": r.search_log,
        "emulated": r.emulated, "parts": [part.as_dict() for part in r.parts],
    }


def _from_record(m: dict[str, Any]) -> ModeMemory:
    states = {k: v for k, v in m["model_states"].items() if k != "total"}
    line = (None if m.get("activations_per_sample") is None
            else ActivationLine(m["activations_fixed"], m["activations_per_sample"]))
    peak = MeasuredPeak(m["measured_peak"], m["measured_source"], m.get("measured_breakdown") or {},
                        m.get("peak_reserved"))
    return ModeMemory(m["precision"], ModelStateBytes(**states), m["activations"], peak, m["step_time_ms"],
                      m["batch_size"], line, m["batch_estimate"], m["batch_found"], m.get("search") or [],
                      m.get("emulated", False), [ModelPart.from_dict(part) for part in m.get("parts", [])])
