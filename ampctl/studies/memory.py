"""`ampctl memory`: the memory model of a run next to its measured peak, per precision mode.

For each mode (and with or without activation checkpointing), in this process one after the other: build
the model, optimizer and scaler as `ampctl train` would, run memory.steps training steps inside the peak
measurement (the first step allocates the optimizer's state), time a few more steps, then count the
activations of one forward. With memory.budget, the activations are counted at a second batch size too and
the largest batch that fits is estimated, then, on CUDA, found by a search of real steps, each probe in a
process of its own. Its tables and files: studies/memory_report.py.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.analysis.memory.measure import measure_peak, release_memory
from ampctl.analysis.memory.model import (
    ActivationLine,
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
from ampctl.studies.memory_report import ModeMemory, write_memory_report

SEARCH_PROBES = 10  # real-step probes of the batch search, at most


class ProbeFailed(Exception):
    """A probe of the batch search ended in an error other than running out of device memory."""


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


def _device_name(device: torch.device) -> str:
    from ampctl.engine import devices

    return devices.device_name(device)
