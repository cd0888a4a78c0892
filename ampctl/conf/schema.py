"""Config schemas: one source of defaults and types, plus the range checks OmegaConf cannot express.

Every YAML in ampctl/conf/ extends one of the schemas stored here (``defaults: [/schema_<group>[_<kind>]@_here_]``):
the run's (train.*, telemetry.*, distributed.*, guard.*) are defined in this module, a precision mode's and its
scaler's in precision_schema.py, the studies' own in study_schema.py (a tracker's options are its class's:
runner/trackers/);
so that a typo'd key or a wrong type is rejected by OmegaConf at compose time. The dataclasses' defaults are the
only ones: a YAML states what differs from them and nothing else (tests/unit/test_config.py checks every
file). Ranges and cross-field rules are each schema's __post_init__; :func:`validate` runs them all (through
OmegaConf.to_object) before anything is built.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from ampctl.conf.precision_schema import SCALER_SCHEMAS, PrecisionConfig
from ampctl.conf.study_schema import AdviseConfig, CompareConfig, InspectConfig, MemoryConfig
from ampctl.conf.value_checks import positive_finite, require
from ampctl.errors import UsageError


class DeviceChoice(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Schedule(Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class PreemptSignal(Enum):  # a batch system's warning before it kills a job (SLURM: --signal=USR1@120)
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGHUP = "SIGHUP"


class ConsoleMode(Enum):
    auto = "auto"  # live view on a terminal, plain lines otherwise
    live = "live"
    plain = "plain"
    quiet = "quiet"


# the eval metrics whose better direction goes without saying (train.monitor_mode: null)
MONITOR_MODES = {"loss": "min", "perplexity": "min", "accuracy": "max"}
EMA_METRIC = "ema_"  # the prefix of a metric of the weight average's (train.ema_decay): eval/ema_loss


def monitor_direction(monitor: str) -> Optional[str]:
    """min | max for a metric whose better direction goes without saying (the average's as the model's), else None."""
    return MONITOR_MODES.get(monitor.removeprefix(EMA_METRIC))
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def safe_to_change(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field a resumed run may change (a node: any key under it), with its default. Every other difference
    from the checkpoint's config is refused, and left out of the hash that identifies a run (runner/identity.py);
    safe_to_change_keys() lists them."""
    return field(default=default, metadata={"safe_to_change": True}, **kwargs)


@dataclass
class TrainConfig:
    """train.*: the loop, checkpoints, evaluation. safe_to_change(...): a resumed run may change it."""

    steps: int = safe_to_change(200)
    grad_accum_steps: int = 1
    clip_grad_norm: Optional[float] = 1.0  # max total grad norm after unscale_; null = no clipping
    log_every: int = safe_to_change(10)  # the only steps that read values back from the device
    seed: int = 0
    lr_schedule: Schedule = Schedule.cosine
    lr_warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine/linear decay ends at lr * min_lr_ratio
    timing_warmup_steps: int = safe_to_change(5)  # first steps left out of median step time and throughput
    console: ConsoleMode = safe_to_change(ConsoleMode.auto)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (gpt, resnet)
    # torch.compile: each block the recipe names (as torchtitan compiles each transformer block), else the model
    compile: bool = safe_to_change(False)
    compile_mode: str = safe_to_change("default")  # torch.compile's mode: one of COMPILE_MODES
    # torch's intra-op threads (torch.set_num_threads); null: torch's own choice, one per core. compare sizes them to
    # the cores other processes leave free (a step waits for whichever thread the scheduler set aside)
    threads: Optional[int] = safe_to_change(None)
    # N: a torch.profiler trace of N steady steps (after the timing warm-up) in the run's profile/, and a summary
    # of where their time went (matmuls, other ops, optimizer, data, ...); null: no profiler
    profile: Optional[int] = safe_to_change(None)
    checkpoint_every: Optional[int] = safe_to_change(None)  # steps between checkpoints; one is always at the end
    # seconds between checkpoints, checked on log steps (every rank decides together there): a crash loses at
    # most this much of a long run whatever checkpoint_every says; null: by steps only
    checkpoint_every_s: Optional[float] = safe_to_change(1800.0)
    # treated as SIGTERM is: finish the step, checkpoint, exit 128 + its number (138 for SIGUSR1); null: ignore it
    preempt_signal: Optional[PreemptSignal] = safe_to_change(PreemptSignal.SIGUSR1)
    # in a SLURM job, the preemption signal also requeues the job (scontrol requeue) once the checkpoint is
    # written; the requeued job continues with resume=auto (Lightning's auto_requeue)
    slurm_requeue: bool = safe_to_change(True)
    # hang detection: no step finished for this many seconds (and 20x the median step) is said, with every
    # thread's stack in hang-step-N.txt; the run goes on (runner/watchdog.py). null: off
    hang_after_s: Optional[float] = safe_to_change(300.0)
    keep_checkpoints: int = safe_to_change(2)  # the newest K checkpoints are kept
    # an fsspec URL (s3://bucket/run, gs://..., memory://...) each checkpoint is uploaded to as well, its checksum
    # last; resume=auto in an empty run directory pulls the newest that verifies (runner/mirror.py). null: none
    checkpoint_mirror: Optional[str] = safe_to_change(None)
    # evaluation on the recipe's held-out batches after every N steps and after the last, under the run's
    # autocast (engine/evaluation.py): evals.jsonl, the summary, the trackers, a line each; null: none
    eval_every: Optional[int] = safe_to_change(None)
    eval_batches: int = safe_to_change(8)  # held-out batches per evaluation
    eval_fp32: bool = safe_to_change(False)  # each evaluation in fp32 too (autocast off; an fp32 copy of O2/O3's model)
    # the K best checkpoints by the eval metric `monitor`, in checkpoints/best/, beside the newest ones
    save_top_k: int = safe_to_change(0)
    monitor: str = "loss"  # an eval metric of the recipe's: loss, accuracy, perplexity, or its own
    monitor_mode: Optional[str] = None  # min | max; null: max for accuracy, min for loss and perplexity
    # an fp32 exponential moving average of the weights (engine/weight_average.py), evaluated beside the model
    # (eval/ema_<metric>), checkpointed; null: none. It is the weights at ema_start_step, then moves toward them
    # after every ema_every-th step
    ema_decay: Optional[float] = None
    ema_start_step: int = 0
    ema_every: int = 1

    def __post_init__(self) -> None:
        for key in ("steps", "grad_accum_steps", "log_every", "keep_checkpoints", "eval_batches"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "an integer >= 1")
        for key in ("lr_warmup_steps", "timing_warmup_steps"):
            require(getattr(self, key) >= 0, f"train.{key}", getattr(self, key), "an integer >= 0")
        if self.threads is not None:
            require(self.threads >= 1, "train.threads", self.threads, "an integer >= 1, or null for one per core")
        if self.checkpoint_every is not None:
            require(self.checkpoint_every >= 1, "train.checkpoint_every", self.checkpoint_every,
                    "an integer >= 1, or null for a checkpoint at the end only")
        if self.checkpoint_every_s is not None:
            require(positive_finite(self.checkpoint_every_s), "train.checkpoint_every_s", self.checkpoint_every_s,
                    "a number of seconds > 0, or null for checkpoints by steps only")
        if self.hang_after_s is not None:
            require(positive_finite(self.hang_after_s), "train.hang_after_s", self.hang_after_s,
                    "a number of seconds > 0, or null for no hang detection")
        require(self.profile is None or self.profile >= 1, "train.profile", self.profile,
                "a number of steps >= 1, or null for no profile")
        require(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        require(self.compile_mode in COMPILE_MODES, "train.compile_mode", self.compile_mode,
                f"one of torch.compile's modes: {', '.join(COMPILE_MODES)}")
        if self.clip_grad_norm is not None:
            require(positive_finite(self.clip_grad_norm), "train.clip_grad_norm", self.clip_grad_norm,
                    "a finite number > 0, or null for no clipping")
        require(self.eval_every is None or self.eval_every >= 1, "train.eval_every", self.eval_every,
                "an integer >= 1, or null for no evaluation")
        require(self.save_top_k >= 0, "train.save_top_k", self.save_top_k, "an integer >= 0")
        require(self.save_top_k == 0 or self.eval_every is not None, "train.save_top_k", self.save_top_k,
                "0 without train.eval_every (the best checkpoints are ranked by an evaluation)")
        require(self.monitor_mode in (None, "min", "max"), "train.monitor_mode", self.monitor_mode, "min | max | null")
        require(self.monitor_mode is not None or monitor_direction(self.monitor) is not None, "train.monitor",
                self.monitor, f"{', '.join(MONITOR_MODES)}, or any metric of the recipe's with "
                "train.monitor_mode=min|max (which way is better); the weight average's with ema_ before them")
        if self.ema_decay is not None:
            require(0.0 < self.ema_decay < 1.0, "train.ema_decay", self.ema_decay,
                    "a number in (0, 1) (0.999: an average over ~1000 steps), or null for no weight average")
        require(self.ema_start_step >= 0, "train.ema_start_step", self.ema_start_step, "an integer >= 0")
        require(self.ema_every >= 1, "train.ema_every", self.ema_every, "an integer >= 1")
        require(not self.monitor.startswith(EMA_METRIC) or self.ema_decay is not None, "train.monitor", self.monitor,
                "a metric of the model's without train.ema_decay (the weight average's metrics need one)")


@dataclass
class TelemetryConfig:
    # every N steps, record per-layer value ranges into ranges.jsonl (ampctl inspect's)
    ranges_every: Optional[int] = None
    # on a CPU, measure peak memory with torch's memory profiler over the build and steps 1-2 (well under 1 s);
    # on CUDA the allocator's peak is always read, for free
    profile_cpu_memory: bool = safe_to_change(True)

    def __post_init__(self) -> None:
        every = self.ranges_every
        require(every is None or every >= 1, "telemetry.ranges_every", every, "an integer >= 1, or null")


class ParallelKind(Enum):
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"


class CheckpointFormat(Enum):
    full = "full"  # one file (step_N.pt): rank 0 writes the whole state, gathered from the shards under fsdp
    sharded = "sharded"  # torch.distributed.checkpoint (step_N.dcp/): each rank writes its own shard


@dataclass
class DistributedConfig:
    kind: ParallelKind = ParallelKind.none
    timeout_s: int = 600  # a collective that waits longer (a rank died or hangs) ends the job with an error
    reshard_after_forward: bool = True  # fsdp: free the gathered weights after forward (ZeRO-3), or keep (ZeRO-2)
    # either format resumes on any number of ranks (DCP reshards a sharded one); fsdp.yaml chooses sharded
    checkpoint_format: CheckpointFormat = CheckpointFormat.full
    # sharded: the state is copied to CPU memory and written by a background thread while training goes on
    async_checkpoint: bool = False

    def __post_init__(self) -> None:
        require(self.timeout_s >= 1, "distributed.timeout_s", self.timeout_s, "an integer >= 1")
        require(not self.async_checkpoint or self.checkpoint_format == CheckpointFormat.sharded,
                "distributed.async_checkpoint", self.async_checkpoint,
                "false with distributed.checkpoint_format=full (async saves are sharded ones)")


class NonfiniteAction(Enum):
    stop = "stop"
    warn = "warn"


@dataclass
class GuardConfig:
    """Checked on log steps (when values come back from the device anyway): never a per-step sync."""

    max_consecutive_skips: Optional[int] = 100  # this many skipped steps in a row stop the run; null: never
    stop_at_min_scale: bool = True  # an overflow at scaler.min_scale stops the run: it cannot back off further
    on_nonfinite: NonfiniteAction = NonfiniteAction.stop  # stop | warn, for a non-finite loss no scaler can absorb

    def __post_init__(self) -> None:
        if self.max_consecutive_skips is not None:
            require(self.max_consecutive_skips >= 1, "guard.max_consecutive_skips", self.max_consecutive_skips,
                    "an integer >= 1, or null to never stop on skipped steps")


@dataclass
class AmpctlConfig:
    """The primary config of `ampctl train`. Open-ended groups (recipe, optimizer) are `_target_` nodes."""

    device: DeviceChoice = DeviceChoice.auto
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    precision: PrecisionConfig = MISSING
    scaler: Any = MISSING
    recipe: Any = MISSING
    optimizer: Any = MISSING
    distributed: DistributedConfig = safe_to_change(MISSING)
    # experiment trackers, any number at once (`logger=[tensorboard,csv]`): each ampctl/conf/logger/<name>.yaml
    # adds its `_target_` node (runner/trackers/), typed there by its class's options
    logger: Dict[str, Any] = safe_to_change(default_factory=dict)
    # a run dir or checkpoint file to continue from; "auto": this run dir's newest
    resume: Optional[str] = safe_to_change(None)


@dataclass
class CompareAppConfig(AmpctlConfig):
    """The primary config of `ampctl compare`: a train config plus what to compare."""

    compare: CompareConfig = field(default_factory=CompareConfig)


@dataclass
class MemoryAppConfig(AmpctlConfig):
    """The primary config of `ampctl memory`: a train config plus what to measure."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class InspectAppConfig(AmpctlConfig):
    """The primary config of `ampctl inspect`: a train config plus what to inspect."""

    inspect: InspectConfig = field(default_factory=InspectConfig)


@dataclass
class AdviseAppConfig(AmpctlConfig):
    """The primary config of `ampctl advise`: a train config, what to advise on, and the settings of the compare
    and inspect studies it runs."""

    advise: AdviseConfig = field(default_factory=AdviseConfig)
    compare: CompareConfig = field(default_factory=lambda: CompareConfig(seeds=3, warmup_steps=5))
    inspect: InspectConfig = field(default_factory=lambda: InspectConfig(steps=2))


def validate(cfg: DictConfig) -> None:
    """Check every value a user can set; raise ConfigError naming the first bad key. Ranges live in each
    schema's __post_init__, which OmegaConf runs when it builds the dataclasses; the open-ended groups
    (recipe, optimizer) are checked here."""
    from omegaconf.errors import OmegaConfBaseException

    from ampctl.conf.messages import one_line  # imports this module

    try:
        OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # a mandatory value left unset (???), an interpolation that fails
        raise UsageError(one_line(exc)) from None
    _refuse_integers_beyond_int64(OmegaConf.to_container(cfg, resolve=True), "")
    for group in ("recipe", "optimizer"):
        node = cfg[group]
        require(isinstance(node, DictConfig) and "_target_" in node, group,
                OmegaConf.to_container(node) if isinstance(node, DictConfig) else node,
                "a config with a _target_ naming an importable callable")
    _check_optimizer_arguments(cfg.optimizer)
    require(not (cfg.train.save_top_k and cfg.distributed.checkpoint_format == CheckpointFormat.sharded),
            "train.save_top_k", cfg.train.save_top_k,
            "0 with distributed.checkpoint_format=sharded (the best checkpoints are whole files: use "
            "distributed.checkpoint_format=full)")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_optimizer_arguments(optimizer: DictConfig) -> None:
    """The arguments torch.optim's optimizers share, by their torch names, checked before a run starts (torch
    checks some only when it builds the optimizer, and reads betas[1] before checking there are two)."""
    lr, betas = optimizer.get("lr"), optimizer.get("betas")
    if lr is not None:
        require(_number(lr) and lr > 0, "optimizer.lr", lr, "a finite number > 0")
    if betas is not None:
        values = list(betas) if isinstance(betas, ListConfig) else betas
        require(isinstance(values, list) and len(values) == 2 and all(_number(b) and 0 <= b < 1 for b in values),
                "optimizer.betas", values, "two numbers in [0, 1), e.g. [0.9, 0.999]")
    for key, allowed, ok in (("eps", "a finite number > 0", lambda x: x > 0),
                             ("weight_decay", "a finite number >= 0", lambda x: x >= 0),
                             ("momentum", "a finite number >= 0", lambda x: x >= 0),
                             ("dampening", "a finite number >= 0", lambda x: x >= 0)):
        value = optimizer.get(key)
        if value is not None and not isinstance(value, ListConfig):  # Adafactor's eps is a pair
            require(_number(value) and ok(value), f"optimizer.{key}", value, allowed)
    for flag in ("fused", "foreach", "capturable", "amsgrad", "maximize", "nesterov", "differentiable", "decoupled"):
        value = optimizer.get(flag)
        require(value is None or isinstance(value, bool), f"optimizer.{flag}", value, "true, false or null")


INT64_MAX = 2**63 - 1


def _refuse_integers_beyond_int64(node: Any, path: str) -> None:
    """Every integer a user sets ends in a torch or NumPy int64 (a step count, a seed, a shape): one that does
    not fit is refused here, naming its key, instead of overflowing deep inside torch."""
    if isinstance(node, dict):
        for key, value in node.items():
            _refuse_integers_beyond_int64(value, f"{path}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _refuse_integers_beyond_int64(value, f"{path[:-1]}[{index}].")
    elif isinstance(node, int) and not isinstance(node, bool):
        require(-INT64_MAX - 1 <= node <= INT64_MAX, path[:-1], node, "an integer that fits in 64 bits (|x| < 2^63)")


def app_schema_name(command: str) -> str:
    """The name a command's primary config schema is stored under: the first default of ampctl/conf/<command>.yaml."""
    return f"ampctl_{command}_schema"


def register_configs(apps: Optional[Mapping[str, type]] = None) -> None:
    """Store the schemas in Hydra's ConfigStore: the groups' that every command composes, train's app schema
    (each study composes its runs' configs from it), and `apps` (command -> its app schema: the router stores the
    one command it runs, shell/command.register_schemas every command's). Each schema is made into a config as it
    is stored (~10 ms), so a process stores only what it composes."""
    cs = ConfigStore.instance()
    for command, node in {"train": AmpctlConfig, **(apps or {})}.items():
        cs.store(name=app_schema_name(command), node=node)
    # Root-level names, not a schema/ group: a group would be listed among the options in `--help`.
    cs.store(name="schema_precision", node=PrecisionConfig)
    cs.store(name="schema_distributed", node=DistributedConfig)
    for name, node in SCALER_SCHEMAS.items():
        cs.store(name=f"schema_scaler_{name}", node=node)


def safe_to_change_keys(schema: type = AmpctlConfig, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys a resumed run may change, from the fields made with safe_to_change(); a node's end in '.'
    (every key under it)."""
    keys: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        node = dataclasses.is_dataclass(hints[f.name])
        if f.metadata.get("safe_to_change"):
            open_node = typing.get_origin(hints[f.name]) is dict  # logger: its trackers' nodes
            keys.append(f"{prefix}{f.name}{'.' if node or open_node else ''}")
        elif node:
            keys += safe_to_change_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(keys)
