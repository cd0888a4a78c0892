"""What a training run says of itself: its start lines (the precision it runs in, the run, where it resumed, what
to expect) and its summary.json (what ran, where, and the figures of its metrics.jsonl)."""

from __future__ import annotations

import platform
import time
from typing import Any, Optional

import torch

from ampctl import machine_load, run_files
from ampctl.analysis import expert_load, mode_advice
from ampctl.conf import precision_schedule
from ampctl.conf.precision_schema import scaler_is_active
from ampctl.engine import determinism, devices, optimizer_states
from ampctl.engine.precision import layers
from ampctl.engine.telemetry import read_metrics, summarize
from ampctl.recipes.base import recipe_title
from ampctl.runner.guarding import escalation_rules

# run: a runner/run.py TrainingRun, built and trained (typed loosely: that module imports this one)


def announce(run: Any) -> None:
    """The start lines: the resolved precision options, the run, where it resumed, what to expect."""
    cfg, policy, state, resume, parallel = run.cfg, run.policy, run.state, run.resume, run.parallel
    echo, device = run.recorder.echo, policy.device
    echo(policy.describe(state.scaler.describe()))
    for line in layer_table(policy):
        echo(line)
    if cfg.precision.schedule:  # the mode above is the one in force where it starts
        echo(precision_schedule.described(cfg))
    n_params = sum(p.numel() for p in state.model.parameters())
    echo(f"recipe={recipe_title(run.choices.get('recipe', type(run.recipe).__name__), cfg.recipe)} "
         f"params={n_params / 1e6:.2f}M device={device.type} ({devices.device_name(device)}) "
         f"torch={torch.__version__} run_dir={run.recorder.run_dir}"
         + (f" | {parallel.describe()}; global batch = recipe.batch_size x {parallel.world_size}"
            if parallel.world_size > 1 else ""))
    if cfg.train.deterministic:
        echo(determinism.described())
    if cfg.train.compile.enabled:  # the first step pauses while it compiles: say so before it does
        blocks = getattr(run.recipe, "activation_checkpoint_blocks", lambda _model: [])(state.model)
        echo(f"torch.compile (mode={cfg.train.compile.mode}): "
             + (f"each of the recipe's {len(blocks)} blocks" if blocks else "the whole model")
             + ", compiled during the first step (its time is reported on its own)")
    if optimizer_states.is_torchao(cfg.optimizer):  # its first step is a silent wait of tens of seconds on a CPU
        echo(f"optimizer {cfg.optimizer._target_}: torchao compiles its update during the first step (tens of "
             "seconds on a CPU, once per process and shape)")
    for failure in resume.passed_over:
        echo(f"warning: {failure}; passed over (set aside, kept)")
    if resume.payload:
        echo(f"resumed from {resume.source} at step {state.step}"
             + (f"; changed: {'; '.join(resume.changes)}" if resume.changes else ""))
    elif cfg.resume == "auto":
        echo(f"resume=auto: no checkpoint in {run.recorder.run_dir} yet, starting from step 0")
        for path in run.recorder.set_aside_rows_without_checkpoint():
            echo(f"resume=auto: rows of a run that left no checkpoint set aside in {path.name}")
    for message in (mode_advice.combination_warnings(policy, scaler_is_active(cfg.scaler))
                    + mode_advice.speed_warnings(policy, cfg.train.compile.enabled)):
        echo(f"warning: {message}")


def layer_table(policy: Any) -> list[str]:
    """What each layer computes in, where layers differ from one another (rules, a converter): the start lines'."""
    planned = policy.layer_plan.rules if policy.layer_plan is not None else policy.precision.rules
    if not (planned or policy.converter is not None):
        return []
    return [f"  {line}" for line in layers.render(policy.layer_rows)]


def summary_of(run: Any) -> dict:
    """summary.json: what ran, where, and the figures of its metrics.jsonl."""
    cfg, policy, state, compiling = run.cfg, run.policy, run.state, run.compiling
    run_dir = run.recorder.run_dir
    device = policy.device
    recipe_name = run.choices.get("recipe", type(run.recipe).__name__)
    # steps run under the CPU memory profiler are never timed, whatever timing_warmup_steps says; nor are the
    # steps that compiled, nor those train.profile profiled
    timing = summarize(read_metrics(run_dir / run_files.METRICS),
                       max(cfg.train.timing_warmup_steps, run.peak.untimed_steps),
                       untimed=set(compiling.compiles_at) | run.profiler.untimed_steps | run.rebuilt_at)
    modes = run.policies  # precision.schedule's modes, as this process built them (one where it has none)
    return {
        "precision": cfg.precision.name,
        "precision_choice": run.choices.get("precision", cfg.precision.name),
        # precision.schedule's changes (the run's mode, then each change's): nvfp4_recipe→bf16@0.82
        "precision_scheduled": precision_schedule.label(cfg) if cfg.precision.schedule else None,
        "schedule": precision_schedule.as_record(cfg),
        # an emulated format's speed is the emulation's, never the format's: said beside every speed shown (of any
        # of the modes precision.schedule trains in)
        "emulated": any(p.emulated for p in modes),
        "converter": _converter_of(modes),
        "scaler": state.scaler.kind,
        "recipe": recipe_name,
        "recipe_title": recipe_title(recipe_name, cfg.recipe),  # with its model
        "optimizer": cfg.optimizer._target_,
        "device": device.type,
        "device_name": devices.device_name(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "parameters": sum(p.numel() for p in state.model.parameters()),
        "world_size": run.parallel.world_size,
        "deterministic": cfg.train.deterministic,  # train.deterministic: torch's deterministic algorithms
        "compiled": cfg.train.compile.enabled,
        "compile_mode": cfg.train.compile.mode if cfg.train.compile.enabled else None,
        "compile_s": round(compiling.seconds, 3) if cfg.train.compile.enabled else None,  # left out of the step times
        "compilations": len(compiling.compiles_at) if cfg.train.compile.enabled else None,
        **timing,
        **run.step_flops.summary(timing.get("median_step_time_ms")),
        "peak_memory_bytes": run.peak.bytes(),
        "peak_memory_source": run.peak.source,
        "profile": run.profiler.summary(),
        # what its throughput shared: the threads torch used, the host, and when its steps ran (Unix time), so
        # that a sweep's table can say which jobs ran at the same time on one machine (reports/tables.py)
        "torch_threads": torch.get_num_threads(),
        "host_memory_held": run.host_memory_held,  # train.hold_host_memory made (glibc, a CPU run)
        "host": platform.node(),
        "training_window": [round(run.steps_began_at, 3), round(time.time(), 3)],
        # the cores other processes kept busy meanwhile: above a quarter of the machine its speed is not its own
        "others_cpu_cores": machine_load.others_cores(run.load_at_start, machine_load.sample()),
        # a mixture of experts' load: the busiest expert's tokens over the mean, the worst layer's, over the run
        "expert_load": expert_load.over_the_run(run_dir / run_files.EXPERTS),
        # with a capacity: the worst layer's share of (token, k) pairs dropped, over the run
        "expert_dropped": expert_load.over_the_run(run_dir / run_files.EXPERTS, "dropped"),
        # guard.on_trip=escalate's: the layers raised and from which step (escalations.jsonl holds each whole)
        "escalations": [{key: row[key] for key in ("number", "tripped_at", "step", "raised", "reason", "evidence")}
                        for row in escalation_rules.recorded(run_dir)],
        "run_dir": str(run_dir),
    }


def _converter_of(modes: list[Any]) -> Optional[dict[str, Any]]:
    """The converter of the first mode that has one (a scheduled run's format, before it switches to bf16)."""
    policy = next((p for p in modes if p.converter is not None), None)
    if policy is None:
        return None
    return {"name": policy.converter.name, "layers": len(policy.converted),
            "checkpoints_carry": policy.converter.checkpoint_state,
            # its resolved options as the start line says them (whose kernels ran; NVFP4's recipe and its RHT signs)
            "described": policy.converter.describe()}
