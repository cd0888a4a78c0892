"""A training run planned once, before anything is written: what `run_training` is handed and checks no more.

The plan is made where the run's config is known as it will run: by the command's check before Hydra creates the
run directory (shell/checks.py), by a sweep's job as it starts, by the Python API, and by the studies that
train (advise's calibration)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from ampctl.analysis import mode_advice
from ampctl.conf import precision_schedule
from ampctl.conf.composing import precision_node
from ampctl.conf.precision_schema import scaler_is_active
from ampctl.conf.schema import CheckpointFormat, ParallelKind, TripAction, validate
from ampctl.engine import devices, optimizer_states
from ampctl.engine import parallel as parallelism
from ampctl.engine.optim import check_optimizer_arguments, check_optimizer_with_scaler
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import UsageError
from ampctl.runner import resume as resuming
from ampctl.runner.layer_error_log import refuse_what_it_cannot_watch
from ampctl.runner.resume import Resume
from ampctl.runner.trackers import check_loggers


@dataclass
class RunPlan:
    """One training run as it will run: its config (a resumed run's own, with the safe changes the command line
    names), its config group choices, its precision policy (checked against the device), and where it starts
    (resume: the checkpoint, checked and loaded, and the run directory it records into). Its trackers are
    checked (installed, their own refusals)."""

    cfg: DictConfig
    choices: dict[str, str]
    policy: PrecisionPolicy
    resume: Resume
    trackers: dict[str, Any] = field(default_factory=dict)  # logger's, checked: {name: (class, typed options)}

    @property
    def run_dir(self) -> Path:
        """The directory the run records into: the checkpoint's own when it resumes another run's."""
        return self.resume.run_dir


def plan_run(cfg: DictConfig, run_dir: Path, choices: Optional[dict[str, str]] = None,
             overrides: Optional[Sequence[str]] = None, world_size: int = 1) -> RunPlan:
    """The run cfg describes, into run_dir, planned: where cfg.resume continues, its policy, its trackers.
    UsageError for what the run would refuse. With the command line's overrides, a resumed run takes its own
    config, with the keys they name taken from cfg (runner/resume.py's plan); without (a config made in Python),
    cfg is the run's config as it is."""
    mirror, options = cfg.train.checkpoint.mirror, _mirror_options(cfg)
    if mirror and cfg.resume == "auto" and holds_none_of_the_run(run_dir):
        pull_from_mirror(mirror, run_dir, world_size, options)
    cfg = precision_schedule.resolved(cfg, precision_node)  # before a resume compares it with the run's own
    if overrides is None:
        cfg, resume = Resume.find(cfg, run_dir, world_size)
    else:
        cfg, choices, resume = resuming.plan(cfg, dict(choices or {}), list(overrides), run_dir, world_size)
    if resume.payload is not None:
        precision_schedule.refuse_a_changed_past(resume.saved_config(), cfg, resume.payload["step"])
    if cfg.train.checkpoint.mirror:
        from ampctl.runner.checkpointing import mirror_check

        mirror_check.check(cfg.train.checkpoint.mirror, resume.run_dir, bool(cfg.resume), _mirror_options(cfg))
    policy = check_config(cfg, resume.step or 0)  # the mode precision.schedule has in force where it starts
    refuse_what_it_cannot_watch(cfg, world_size)  # train.diff.every
    first_profiled(cfg, policy.device, resume.step or 0)  # train.profile's window within the run
    return RunPlan(cfg, dict(choices or {}), policy, resume, check_loggers(cfg.logger))


def first_profiled(cfg: DictConfig, device: Any, start_step: int) -> int:
    """The first step train.profile profiles: past the steps the run does not time (the timing warm-up, the CPU
    memory measurement, the compiling first step) and the profiler's own warm-up step. UsageError where the window
    ends past train.steps."""
    from ampctl.analysis.memory.measure import MEASURED_STEPS
    from ampctl.runner.profile_window import first_profiled_step

    # the CPU memory profiler measures a CPU run's first steps, unless it is compiled (it would record torch.compile)
    measures_cpu = (device.type == "cpu" and cfg.telemetry.profile_cpu_memory and not cfg.train.compile.enabled)
    settled = max(cfg.train.timing_warmup_steps, MEASURED_STEPS if measures_cpu else 0,
                  1 if cfg.train.compile.enabled else 0)
    return first_profiled_step(cfg.train.profile, cfg.train.steps, settled, start_step)


def holds_none_of_the_run(run_dir: Path) -> bool:
    """A run directory on a machine the run never ran on: no identity, no checkpoint (Hydra's files at most)."""
    from ampctl import run_files
    from ampctl.runner.checkpointing.checkpoint_files import list_checkpoints

    return not (run_dir / run_files.IDENTITY).is_file() and not list_checkpoints(run_dir)


def _mirror_options(cfg: DictConfig) -> dict[str, Any]:
    """train.checkpoint.mirror_options as plain values (fsspec's storage_options)."""
    return OmegaConf.to_container(cfg.train.checkpoint.mirror_options, resolve=True)  # type: ignore[return-value]


def pull_from_mirror(url: str, run_dir: Path, world_size: int, options: dict[str, Any]) -> None:
    """resume=auto on a machine without the run: the mirror's run into run_dir (runner/checkpointing/mirror.py)."""
    from ampctl.runner.checkpointing import mirror as mirroring

    if world_size > 1:
        raise UsageError(f"resume=auto with train.checkpoint.mirror={url}: {run_dir} holds none of the run, and "
                         f"{world_size} ranks would each pull it; pull it with one process first (the same command "
                         "without torchrun pulls it as it starts), or copy the mirror's files into it")
    mirroring.pull(url, run_dir, lambda line: print(line, flush=True), options)


def refuse_parallelism_without_torchrun(kind: ParallelKind) -> None:
    """distributed=ddp|fsdp outside torchrun: the command that starts it, in one line."""
    import os

    missing = [name for name in parallelism.TORCHRUN_VARIABLES if name not in os.environ]
    if kind is not ParallelKind.none and missing:
        raise UsageError(f"distributed={kind.value} runs under torchrun (no {', '.join(missing)} here): "
                         f"torchrun --nproc_per_node=N -m ampctl train distributed={kind.value} ...")


def check_config(cfg: DictConfig, done: int = 0) -> PrecisionPolicy:
    """Everything that can be refused before building anything: ranges, then what the device can do, for each
    segment of precision.schedule as a run of its own. The policy it returns (the one in force for the step after
    `done` steps) is what engine/build.py's build_state builds with."""
    validate(cfg)
    cfg = precision_schedule.resolved(cfg, precision_node)
    precision_schedule.refuse_a_bad_order(cfg)
    segments = precision_schedule.segments(cfg)
    if len(segments) > 1:
        refuse_what_cannot_switch(cfg, segments)
    policies = [(segment.after, _check_mode(precision_schedule.config_of(cfg, segment) if segment.after else cfg))
                for segment in segments]
    refuse_block_scales_without_blocks(cfg, [policy for _, policy in policies])
    return [policy for after, policy in policies if after <= done][-1]


def _check_mode(cfg: DictConfig) -> PrecisionPolicy:
    """check_config's checks of one mode (a segment's, its precision node in force)."""
    parallelism.check(cfg)
    refuse_parallelism_without_torchrun(cfg.distributed.kind)
    device = parallelism.local_device(devices.resolve_device(cfg.device.value), cfg.distributed.kind)
    policy = PrecisionPolicy(OmegaConf.to_object(cfg.precision), device)
    mode_advice.check(policy)
    refuse_what_cannot_escalate(cfg, policy)
    if cfg.train.eval.every and cfg.train.eval.fp32 and policy.converts_layers():
        raise UsageError(f"train.eval.fp32=true with precision={policy.precision.name}: its converted layers "
                         "compute in their format whatever autocast says; evaluate an fp32 run beside it "
                         "(ampctl compare)")
    # FSDP2 keeps fp32 parameters, reduces in float32 and accumulates unsynced micro-batches in its reduce dtype:
    # float32 accumulation is its own; DDP all-reduces half weights' gradients in their own dtype
    if (policy.precision.grad_accum_dtype is not None and cfg.distributed.kind is ParallelKind.ddp
            and policy.precision.cast_model):
        raise UsageError(f"precision.grad_accum_dtype={policy.precision.grad_accum_dtype} with distributed=ddp and "
                         f"precision={cfg.precision.name}: not supported yet (DDP all-reduces the half weights' "
                         "gradients in their own dtype); run it in one process, or under distributed=fsdp with "
                         "precision=bf16 or fp16 (fp32 parameters: FSDP reduces and accumulates in float32)")
    check_optimizer_with_scaler(cfg.optimizer, scaler_is_active(cfg.scaler))
    check_optimizer_arguments(cfg.optimizer)
    optimizer_states.check(cfg.optimizer, policy.precision.dtype.name,
                           policy.precision.cast_model and not policy.precision.master_weights,
                           cfg.distributed.kind is ParallelKind.fsdp
                           and cfg.distributed.checkpoint_format is CheckpointFormat.full)
    return policy


def refuse_block_scales_without_blocks(cfg: DictConfig, policies: list[PrecisionPolicy]) -> None:
    """telemetry.blocks_every needs a layer that computes in a block-scaled format, by the mode or by a rule (in one
    of the run's modes, where its precision.schedule changes it)."""
    from ampctl.engine.precision.mx_emulated import MXFormat

    if cfg.telemetry.blocks_every is None:
        return
    computed = {rule.run_in for policy in policies for rule in policy.precision.rules}
    computed |= {policy.converter.default_format() for policy in policies if policy.converter is not None}
    if not computed & {f.value for f in MXFormat}:
        raise UsageError(f"telemetry.blocks_every={cfg.telemetry.blocks_every} with precision={cfg.precision.name}: "
                         "no layer computes in a block-scaled format; it records mxfp8, mxfp4 and nvfp4 layers (a "
                         "mode, or precision.rules' run_in)")
    torchao = next((policy for policy in policies if getattr(policy.converter, "torchao", False)), None)
    if torchao is not None:
        raise UsageError(f"telemetry.blocks_every={cfg.telemetry.blocks_every} with precision.options.kernels="
                         f"{torchao.converter.options.kernels.value}: it observes ampctl's emulated layers, and "
                         "torchao's compute these; precision.options.kernels=emulated records the same numerics")


def refuse_what_cannot_switch(cfg: DictConfig, segments: list[precision_schedule.Segment]) -> None:
    """precision.schedule's changes rebuild the run from a checkpoint (runner/run.py): between modes that hold the
    weights alike, in one process, with its own decisions (no escalation), and a profile window in its first mode."""
    first, own = segments[1], segments[0].node
    for segment in segments[1:]:
        kept = {key: (own.get(key), segment.node.get(key)) for key in ("cast_model", "master_weights")}
        changed = [f"{key} {old} -> {new}" for key, (old, new) in kept.items() if old != new]
        if changed:
            raise UsageError(f"precision.schedule: {own['name']} -> {segment.mode} at {segment.point} changes how the "
                             f"weights are held ({', '.join(changed)}): not supported; schedule among modes that keep "
                             "fp32 weights (fp32, tf32, bf16, fp16, fp8, fp8_emulated, mxfp8, mxfp4, nvfp4, "
                             "nvfp4_recipe) or among O2/O3/bf16_true's alike")
    if cfg.distributed.kind is not ParallelKind.none:
        raise UsageError(f"precision.schedule with distributed={cfg.distributed.kind.value}: not supported yet (the "
                         "switch rebuilds the run from its checkpoint in one process); run the modes as a run and its "
                         "resume with precision.schedule changed on resume")
    if cfg.guard.on_trip is TripAction.escalate:
        raise UsageError("guard.on_trip=escalate with precision.schedule: not supported (an escalation's rules and "
                         "the schedule's modes would both decide the layers); use guard.on_trip=stop")
    if cfg.train.profile is not None:
        start = first_profiled(cfg, devices.resolve_device(cfg.device.value), 0)
        end = start + cfg.train.profile - 1
        if end > first.after:
            raise UsageError(f"train.profile={cfg.train.profile} with precision.schedule: the profiled steps "
                             f"{start}-{end} reach past the change after step {first.after} ({first.mode}); it "
                             "profiles the run's first mode: lower train.profile, or put the change later")


def refuse_what_cannot_escalate(cfg: DictConfig, policy: PrecisionPolicy) -> None:
    """guard.on_trip=escalate (runner/guarding/escalation.py) in one process, in a mode with a layer to raise."""
    if cfg.guard.on_trip is not TripAction.escalate:
        return
    if cfg.distributed.kind is not ParallelKind.none:
        raise UsageError(f"guard.on_trip=escalate with distributed={cfg.distributed.kind.value}: the replay that "
                         "names the layers runs in one process; use guard.on_trip=stop, and resume with "
                         "precision.rules for the layers its diagnosis names")
    p = policy.precision
    if not (p.autocast or p.cast_model or policy.converts_layers() or p.rules):
        raise UsageError(f"guard.on_trip=escalate with precision={p.name}: no layer runs in a half type or a "
                         "converter's format, so there is none a rule can raise; use guard.on_trip=stop")


def continuing_a_requeued_job(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """cfg, with resume=auto when this process is the batch job that started the run in run_dir, requeued by its
    engine (which runs the job's original overrides again): it continues its own run, as it was stopped to do."""
    from ampctl.processes import is_main_process
    from ampctl.runner.identity import requeued_here

    if cfg.resume:
        return cfg
    own = requeued_here(run_dir, cfg)  # every rank reads the run's identity (storage every node shares)
    if own is None:
        return cfg
    if is_main_process():
        print(f"ampctl train: batch job {own.job} was requeued: it continues its run in {run_dir}", flush=True)
    return _resumed(cfg)


def continuing_a_jobs_earlier_attempt(cfg: DictConfig, run_dir: Path, num: int) -> DictConfig:
    """A sweep's job whose directory holds a run already: the same job started again by the engine that runs it
    (Ray retries a task whose worker died; a batch system requeues a job) with its original overrides. The sweep's
    directory was checked to be this sweep's before its first job, and each job has a directory of its own, so a
    run there with this job's config is this job's earlier attempt: it continues (it trained again from step 0 over
    the earlier attempt's records, every step twice in metrics.jsonl). One with another config is refused."""
    from ampctl.processes import is_main_process
    from ampctl.runner import identity

    if cfg.resume:
        return cfg
    earlier = identity.read(run_dir)
    if earlier is None:
        return cfg
    if identity.config_hash(identity.resolved(cfg)) != earlier.config_hash:
        raise UsageError(f"{run_dir} holds a run with another config than job #{num}'s (run {earlier.run_id[:8]}): "
                         "a sweep's job continues only its own earlier attempt")
    if is_main_process():
        print(f"ampctl train: job #{num} started again (its engine retried it): it continues its earlier attempt "
              f"in {run_dir}", flush=True)
    return _resumed(cfg)


def _resumed(cfg: DictConfig) -> DictConfig:
    continued = cfg.copy()
    continued.resume = "auto"
    return continued
