"""Compose one training run from a validated config: policy, recipe, model, optimizer, scaler, schedule,
telemetry; run the loop; write the run directory (metrics.jsonl, summary.json)."""

from __future__ import annotations

import contextlib
import json
import platform
import signal
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig

from ampctl import io
from ampctl.analysis.memory.measure import TrainingPeak
from ampctl.conf.schema import scaler_is_active
from ampctl.engine import devices
from ampctl.engine import parallel as parallelism
from ampctl.engine.build import build_state, check_config
from ampctl.engine.loop import fit
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.telemetry import JsonlSink, Telemetry, read_metrics, summarize
from ampctl.errors import RunStopped
from ampctl.recipes.base import build_recipe
from ampctl.runner import checkpoint
from ampctl.runner.console import make_console_sink, say
from ampctl.runner.diagnose import DIAGNOSIS_FILE, replay
from ampctl.runner.guards import Guard, GuardStop
from ampctl.runner.interrupt import Interrupted, StopOnSignal


def _silent(_message: str) -> None:
    pass


def run_training(
    cfg: DictConfig, run_dir: Path, choices: Optional[dict[str, str]] = None, echo: Callable[[str], None] = say
) -> dict:
    """Train as cfg says, recording into run_dir (the checkpoint's run dir when resuming from another).
    Returns the summary. Raises UsageError for user mistakes, Interrupted after SIGINT/SIGTERM."""
    choices = choices or {}
    policy = check_config(cfg)
    parallel = parallelism.start(cfg, policy.device, policy.dtype if policy.precision.autocast else None)
    try:
        summary = _run(cfg, run_dir, choices, echo, policy, parallel)
        parallel.barrier()  # ranks leave together: none tears the group down while another still talks to it
        return summary
    finally:
        parallel.close()


def _run(cfg: DictConfig, run_dir: Path, choices: dict[str, str], echo: Callable[[str], None],
         policy: PrecisionPolicy, parallel: parallelism.SingleProcess) -> dict:
    device = policy.device
    run_dir = parallel.main_value(run_dir)  # every rank records into (and resumes from) rank 0's run dir
    if not parallel.is_main:
        echo = _silent  # only rank 0 speaks; the others raise their errors
    resume_from = checkpoint.resolve_resume(cfg.resume, run_dir) if cfg.resume else None
    payload = checkpoint.load(resume_from) if resume_from else None
    changes = checkpoint.config_changes(payload["config"], cfg) if payload else []
    if resume_from:
        run_dir = checkpoint.run_dir_of(resume_from)
    recipe = build_recipe(parallelism.global_recipe_config(cfg.recipe, parallel.world_size))
    if parallel.world_size > 1:
        recipe = parallelism.RankShard(recipe, parallel.rank, parallel.world_size)

    peak = TrainingPeak(device)
    measure = parallel.is_main and (device.type == "cuda" or cfg.telemetry.profile_cpu_memory)
    with policy, peak.measuring(enabled=measure):  # the peak counts the model's build
        state = build_state(cfg, policy, recipe, parallel)
        if payload:
            checkpoint.restore(payload, state)
        model, scaler = state.model, state.scaler
        n_params = sum(p.numel() for p in model.parameters())
        echo(policy.describe(scaler.describe()))
        echo(
            f"recipe={choices.get('recipe', type(recipe).__name__)} params={n_params / 1e6:.2f}M "
            f"device={device.type} ({devices.device_name(device)}) torch={torch.__version__} run_dir={run_dir}"
            + (f" | {parallel.describe()}; global batch = recipe.batch_size x {parallel.world_size}"
               if parallel.world_size > 1 else "")
        )
        if payload:
            echo(f"resumed from {resume_from} at step {state.step}" + (f"; changed: {'; '.join(changes)}" if changes else ""))
        elif cfg.resume == "auto":
            echo(f"resume=auto: no checkpoint in {run_dir} yet, starting from step 0")
        for message in policy.combination_warnings(scaler_is_active(cfg.scaler)) + policy.speed_warnings():
            echo(f"warning: {message}")

        # throughput is the whole job's: every rank's samples
        per_step = cfg.train.grad_accum_steps * parallel.world_size
        samples = recipe.samples_per_batch * per_step
        tokens = None if recipe.tokens_per_batch is None else recipe.tokens_per_batch * per_step
        sinks: list = []
        if parallel.is_main:  # one record of the run, rank 0's (the loss is the mean over ranks)
            run_dir.mkdir(parents=True, exist_ok=True)
            if payload:
                keep_metrics_up_to(run_dir / "metrics.jsonl", state.step)
                keep_ranges_up_to(run_dir / "ranges.jsonl", state.step)
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
            console = make_console_sink(cfg.train.console, cfg.train.steps, tokens is not None, peak.bytes)
            if console is not None:
                sinks.append(console)
        telemetry = Telemetry(device, cfg.train.log_every, samples, tokens, sinks)
        telemetry.skipped_total = payload["skipped_total"] if payload else 0
        last_checkpoint: list[Path] = []
        guard = Guard(cfg.guard, scaler.can_skip, cfg.scaler.get("min_scale") if scaler.kind == "dynamic" else None)

        def after_step(last: bool) -> None:
            peak.after_step()
            fresh = telemetry.take_fresh()  # non-empty on log steps, when values came back from the device
            if fresh:
                trip, warnings = guard.check(fresh)
                for message in warnings:
                    echo(f"warning: {message}")
                if trip:
                    raise GuardStop(trip)
            every = cfg.train.checkpoint_every
            if last or (every is not None and state.step % every == 0):
                telemetry.flush()  # the steps a checkpoint covers are in metrics.jsonl before it exists
                payload_now = checkpoint.capture(state, cfg, state.step * cfg.train.grad_accum_steps,
                                                 telemetry.skipped_total)
                # Ranks hold the same weights and states (DDP): rank 0's full state dict is the checkpoint,
                # and a resumed job, of any size, loads it on every rank.
                path = checkpoint.checkpoint_path(run_dir, state.step)
                if parallel.is_main:
                    checkpoint.save(payload_now, run_dir, cfg.train.keep_checkpoints)
                last_checkpoint[:] = [path]

        ranges_log = None
        if cfg.telemetry.ranges_every and parallel.is_main:
            from ampctl.analysis.ranges import RangesLog

            ranges_log = RangesLog(state.model, scaler, device, cfg.telemetry.ranges_every, run_dir / RangesLog.FILE)

        def stop_requested() -> bool:
            if parallel.world_size == 1:
                return stop.requested
            # Every rank must stop after the same step, or the others wait in a collective: they agree on
            # log steps, where the host reads from the device anyway.
            return state.step % cfg.train.log_every == 0 and parallel.agree(stop.requested)

        try:
            announce = "after this step" if parallel.world_size == 1 else "at the next log step (all ranks together)"
            with StopOnSignal(announce if parallel.is_main else "") as stop:
                finished = fit(
                    state,
                    recipe,
                    policy,
                    steps=cfg.train.steps,
                    grad_accum_steps=cfg.train.grad_accum_steps,
                    clip_grad_norm=cfg.train.clip_grad_norm,
                    seed=cfg.train.seed,
                    telemetry=telemetry,
                    after_step=after_step,
                    stop_requested=stop_requested,
                    around_step=ranges_log.around if ranges_log else (lambda _step: contextlib.nullcontext()),
                )
        except GuardStop as stop_exc:
            telemetry.close()
            if not parallel.is_main:
                raise RunStopped(stop_exc.trip.reason) from None
            echo(f"stopped: {stop_exc.trip.reason}; replaying step {stop_exc.trip.step} to find the layer...")
            diagnosis = replay(cfg, policy, recipe, run_dir, stop_exc.trip.step, stop_exc.trip.reason)
            raise RunStopped(f"{stop_exc.trip.reason}. {diagnosis['summary']}. Written to {run_dir / DIAGNOSIS_FILE}") from None
        finally:
            telemetry.close()
        if not finished:
            # a rank that agreed to stop without a signal of its own (distributed) reports SIGTERM's code
            raise Interrupted(stop.signum or signal.SIGTERM, state.step, str(last_checkpoint[0]) if last_checkpoint else None)

    if not parallel.is_main:
        return {"run_dir": str(run_dir)}
    summary = {
        "precision": cfg.precision.name,
        "precision_choice": choices.get("precision", cfg.precision.name),
        "scaler": scaler.kind,
        "recipe": choices.get("recipe", type(recipe).__name__),
        "optimizer": cfg.optimizer._target_,
        "device": device.type,
        "device_name": devices.device_name(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "parameters": n_params,
        "world_size": parallel.world_size,
        # steps run under the CPU memory profiler are never timed, whatever timing_warmup_steps says
        **summarize(read_metrics(run_dir / "metrics.jsonl"), max(cfg.train.timing_warmup_steps, peak.untimed_steps)),
        "peak_memory_bytes": peak.bytes(),
        "peak_memory_source": peak.source,
        "run_dir": str(run_dir),
    }
    io.write_json(run_dir / "summary.json", summary)
    echo(final_line(summary, run_dir))
    return summary


def keep_metrics_up_to(path: Path, step: int) -> None:
    """Resuming at `step`: drop the rows a killed run wrote after its checkpoint (and a line cut by the
    kill), so that metrics.jsonl continues without gaps or duplicates."""
    if not path.is_file():
        return
    kept = [line for line, record in zip(path.read_text(encoding="utf-8").splitlines(), read_metrics(path))
            if record.step <= step]
    io.atomic_write_text(path, "".join(line + "\n" for line in kept))


def keep_ranges_up_to(path: Path, step: int) -> None:
    """As keep_metrics_up_to, for telemetry.ranges_every's ranges.jsonl."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a line cut by a kill ends what was written
    io.atomic_write_text(path, "".join(line + "\n" for line in kept))


def final_line(summary: dict, run_dir: Path) -> str:
    rate = (f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary
            else f"{summary['samples_per_s']:,.0f} samples/s")
    return (
        f"done: {summary['steps']} steps | final loss {summary['final_loss']:.4f} | skipped "
        f"{summary['skipped_total']} | final scale {summary['final_loss_scale']:g} | median "
        f"{summary['median_step_time_ms']:.1f} ms/step, {rate} | {run_dir / 'summary.json'}"
    )
