"""Config schemas: one source of defaults and types, plus the range checks OmegaConf cannot express.

Every YAML in ampctl/conf/ extends one of the schemas stored here (``defaults: [/schema_<group>[_<kind>]@_here_]``),
so a typo'd key or a wrong type is rejected by OmegaConf at compose time. The dataclasses' defaults are the
only ones: a YAML states what differs from them and nothing else (tests/unit/test_config.py checks every
file). Ranges and cross-field rules are each schema's __post_init__; :func:`validate` runs them all (through
OmegaConf.to_object) before anything is built.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from ampctl.conf.checks import LOSS_SCALE_ALLOWED, loss_scale_ok, positive_finite, require, yaml_text
from ampctl.errors import UsageError


class DeviceChoice(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


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


class Fp8Scaling(Enum):
    current = "current"
    delayed = "delayed"
    blockwise = "blockwise"


class Fp8Format(Enum):
    hybrid = "hybrid"
    e4m3 = "e4m3"


class AmaxAlgo(Enum):
    max = "max"
    most_recent = "most_recent"


@dataclass
class Fp8EmulatedConfig:
    """Emulated FP8 for every Linear's matmul inputs (ampctl/engine/precision/fp8_emulated.py)."""

    # current (per tensor, this step) | delayed (amax history, TE) | blockwise (DeepSeek-V3, e4m3 only)
    scaling: Fp8Scaling = Fp8Scaling.current
    format: Fp8Format = Fp8Format.hybrid  # hybrid: e4m3 forward, e5m2 gradients | e4m3
    amax_history_len: int = 16  # delayed scaling
    amax_compute_algo: AmaxAlgo = AmaxAlgo.max  # delayed scaling: max | most_recent
    margin: int = 0  # scales map amax to the format's max / 2^margin

    def __post_init__(self) -> None:
        require(self.amax_history_len >= 1, "precision.fp8_emulated.amax_history_len", self.amax_history_len,
                "an integer >= 1")
        require(self.margin >= 0, "precision.fp8_emulated.margin", self.margin, "an integer >= 0")
        require(not (self.scaling is Fp8Scaling.blockwise and self.format is Fp8Format.hybrid),
                "precision.fp8_emulated.format", self.format.name,
                "e4m3 with scaling=blockwise (DeepSeek-V3's fine-grained scaling is E4M3 only)")


class Float8RecipeName(str, Enum):  # a str too: the FP8 code compares it with its names
    tensorwise = "tensorwise"
    rowwise = "rowwise"


@dataclass
class Fp8TorchaoConfig:
    """Real FP8 through torchao's float8 training (ampctl/engine/precision/fp8_torchao.py)."""

    # tensorwise: one scale per tensor | rowwise: one per row (more accurate, slower)
    recipe_name: Float8RecipeName = Float8RecipeName.tensorwise
    auto_filter_small_kn: bool = True  # keep Linear layers too small to gain from FP8 in bf16 (torchao's heuristics)
    filter_fqns: list[str] = field(default_factory=list)  # keep Linear layers whose name contains one of these in bf16


class MXFormat(str, Enum):  # a str too: the MX code compares it with its names
    mxfp8 = "mxfp8"  # OCP MX: 8-bit elements (E4M3 or E5M2), blocks of 32, E8M0 scales
    mxfp4 = "mxfp4"  # OCP MX: E2M1 elements, blocks of 32, E8M0 scales
    nvfp4 = "nvfp4"  # NVIDIA: E2M1 elements, blocks of 16, E4M3 scales and an fp32 per-tensor scale


class MXElements(str, Enum):
    e4m3 = "e4m3"
    e5m2 = "e5m2"


class MXScaleMode(str, Enum):  # torchao's ScaleCalculationMode: how an E8M0 scale is rounded from a block's amax
    floor = "floor"  # the OCP MX v1.0 specification's rule
    rceil = "rceil"  # NVIDIA's (cuBLAS, Transformer Engine)
    ceil = "ceil"
    even = "even"


@dataclass
class MXEmulatedConfig:
    """The emulated microscaling formats of Linear layers (ampctl/engine/precision/mx_emulated.py)."""

    format: MXFormat = MXFormat.mxfp8
    elements: MXElements = MXElements.e4m3  # mxfp8: the elements of activations and weights
    grad_elements: MXElements = MXElements.e4m3  # mxfp8: the elements of gradients (e5m2: more range, less precision)
    scale_mode: MXScaleMode = MXScaleMode.floor  # mxfp8, mxfp4: how each block's E8M0 scale is rounded
    per_tensor_scale: bool = True  # nvfp4: the second-level fp32 scale from each tensor's amax

    def __post_init__(self) -> None:
        if self.format != MXFormat.mxfp8:
            for key in ("elements", "grad_elements"):
                require(getattr(self, key) == MXElements.e4m3, f"precision.mx.{key}", getattr(self, key).name,
                        f"e4m3 (the default) with format={self.format.name}, whose elements are E2M1")
        if self.format == MXFormat.nvfp4:
            require(self.scale_mode == MXScaleMode.floor, "precision.mx.scale_mode", self.scale_mode.name,
                    "floor (the default) with format=nvfp4, whose block scales are E4M3, not E8M0")


LAYER_DTYPES = ("fp32", "bf16", "fp16")  # what a rule may keep a layer's math in, besides a converter's formats
UNCONVERTED = "unconverted"  # a rule's run_in that leaves its layers out of the mode's converter


@dataclass
class LayerRule:
    """A per-layer precision rule (ampctl/engine/precision/layers.py; docs/precision.md): the layers it matches, by
    qualified name and/or by type, and what they run in. The first rule that matches a layer decides it; a layer
    no rule matches runs as its parent does; a rule on a container decides everything inside it."""

    # fp32 | bf16 | fp16 | unconverted | a converter's format: fp8_emulated, mxfp8, mxfp4, nvfp4, fp8
    run_in: str = MISSING
    match: Optional[str] = None  # a glob over qualified module names: head, blocks.0.*, blocks.*.attn.qkv
    type: Optional[str] = None  # a glob over the class names of the module and its bases (LayerNorm, *Embedding);
    # `norm`: every normalization layer (torch's, and leaf modules named like them: LlamaRMSNorm, T5LayerNorm)

    def __post_init__(self) -> None:
        require(bool(self.match or self.type), "precision.rules[].match", None,
                "a glob over layer names, or a type (each rule needs at least one: match=head or type=LayerNorm)")


@dataclass
class PrecisionConfig:
    """One precision mode. The YAMLs in ampctl/conf/precision/ are rows of docs/precision.md's table."""

    name: str = MISSING
    description: str = ""
    autocast: bool = False  # run forward under torch.autocast(dtype)
    dtype: Dtype = Dtype.float32  # the low-precision dtype: autocast's, or the model's when cast_model
    cast_model: bool = False  # O2/O3: the model's weights are stored in `dtype`
    master_weights: bool = False  # O2: the optimizer steps on fp32 copies of the half weights
    tf32: bool = False  # TF32 for matmul and cuDNN convolutions; false means explicitly off
    # The model converter of a converter-style mode (ampctl/engine/precision/converters.py), by its registered
    # name; its options are the node named by the converter (fp8_emulated, fp8_torchao, mx), or `options`.
    converter: Optional[str] = None
    options: Optional[dict[str, Any]] = None  # the options of a converter registered by another package
    fp8_emulated: Optional[Fp8EmulatedConfig] = None  # precision=fp8_emulated: FP8 inputs for every nn.Linear
    fp8_torchao: Optional[Fp8TorchaoConfig] = None  # precision=fp8: torchao's FP8 matmuls for large nn.Linear layers
    mx: Optional[MXEmulatedConfig] = None  # precision=mxfp8, mxfp4, nvfp4: emulated microscaling Linear layers
    rules: list[LayerRule] = field(default_factory=list)  # per-layer precision, first match wins (O2: norms in fp32)

    def __post_init__(self) -> None:
        half = self.dtype in (Dtype.float16, Dtype.bfloat16)
        if self.autocast or self.cast_model:
            require(half, "precision.dtype", self.dtype.name, "float16 or bfloat16 when autocast or cast_model is on")
        else:
            require(not half, "precision.dtype", self.dtype.name, "float32 when neither autocast nor cast_model is on")
        require(not (self.autocast and self.cast_model), "precision.cast_model", self.cast_model,
                "false with autocast=true (autocast over a half model is not a supported mode; use O2 or O3)")
        require(not self.master_weights or self.cast_model, "precision.master_weights", self.master_weights,
                "false unless cast_model=true (fp32 weights are already their own masters)")
        require(not (self.tf32 and half), "precision.tf32", self.tf32,
                "false for half-precision modes (tf32 is its own mode: precision=tf32)")
        if self.fp8_torchao is not None:
            require(self.fp8_emulated is None, "precision.fp8_emulated", "set",
                    "unset with precision.fp8_torchao (emulated or real FP8, not both)")
            require(self.autocast and self.dtype == Dtype.bfloat16, "precision.dtype", self.dtype.name,
                    "bfloat16 with autocast=true under precision.fp8_torchao (torchao's FP8 layers run inside bf16 "
                    "autocast)")


@dataclass
class NoScalerConfig:
    kind: str = "none"


@dataclass
class StaticScalerConfig:
    kind: str = "static"
    scale: float = 1.0

    def __post_init__(self) -> None:
        require(loss_scale_ok(self.scale), "scaler.scale", self.scale, LOSS_SCALE_ALLOWED)


# torch.amp.GradScaler's defaults: the one place ampctl writes them
GRADSCALER_INIT_SCALE = 2.0**16
GRADSCALER_GROWTH_INTERVAL = 2000


@dataclass
class DynamicScalerConfig:
    """torch.amp.GradScaler's arguments, same names and defaults, plus optional bounds."""

    kind: str = "dynamic"
    init_scale: float = GRADSCALER_INIT_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = GRADSCALER_GROWTH_INTERVAL
    enabled: bool = True
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    hysteresis: int = 1  # backs off at the N-th overflow since the scale last grew, N-1 tolerated (1 = GradScaler's)

    def __post_init__(self) -> None:
        require(loss_scale_ok(self.init_scale), "scaler.init_scale", self.init_scale, LOSS_SCALE_ALLOWED)
        require(self.growth_factor > 1.0 and math.isfinite(self.growth_factor), "scaler.growth_factor",
                self.growth_factor, "a finite number > 1")
        require(0.0 < self.backoff_factor < 1.0, "scaler.backoff_factor", self.backoff_factor, "a number in (0, 1)")
        require(self.growth_interval >= 1, "scaler.growth_interval", self.growth_interval, "an integer >= 1")
        for key in ("min_scale", "max_scale"):
            value = getattr(self, key)
            if value is not None:
                require(loss_scale_ok(value), f"scaler.{key}", value, LOSS_SCALE_ALLOWED + ", or null")
        require(self.hysteresis >= 1, "scaler.hysteresis", self.hysteresis, "an integer >= 1")
        if self.min_scale is not None and self.max_scale is not None:
            require(self.min_scale <= self.max_scale, "scaler.min_scale", self.min_scale,
                    f"<= scaler.max_scale ({self.max_scale})")
        # Apex starts at min(max_scale, init_scale) silently; a start outside the bounds is refused instead, so
        # that the scale recorded at step 1 is the one the user asked for.
        low = -math.inf if self.min_scale is None else self.min_scale
        high = math.inf if self.max_scale is None else self.max_scale
        require(low <= self.init_scale <= high, "scaler.init_scale", self.init_scale,
                f"a value within [scaler.min_scale, scaler.max_scale] = [{yaml_text(self.min_scale)}, "
                f"{yaml_text(self.max_scale)}]")


# the eval metrics whose better direction goes without saying (train.monitor_mode: null)
MONITOR_MODES = {"loss": "min", "perplexity": "min", "accuracy": "max"}
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
    # evaluation on the recipe's held-out batches after every N steps and after the last, under the run's
    # autocast (engine/evaluation.py): evals.jsonl, the summary, the trackers, a line each; null: none
    eval_every: Optional[int] = safe_to_change(None)
    eval_batches: int = safe_to_change(8)  # held-out batches per evaluation
    eval_fp32: bool = safe_to_change(False)  # each evaluation in fp32 too (autocast off; an fp32 copy of O2/O3's model)
    # the K best checkpoints by the eval metric `monitor`, in checkpoints/best/, beside the newest ones
    save_top_k: int = safe_to_change(0)
    monitor: str = "loss"  # an eval metric of the recipe's: loss, accuracy, perplexity, or its own
    monitor_mode: Optional[str] = None  # min | max; null: max for accuracy, min for loss and perplexity

    def __post_init__(self) -> None:
        for key in ("steps", "grad_accum_steps", "log_every", "keep_checkpoints", "eval_batches"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "an integer >= 1")
        for key in ("lr_warmup_steps", "timing_warmup_steps"):
            require(getattr(self, key) >= 0, f"train.{key}", getattr(self, key), "an integer >= 0")
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
        require(self.monitor_mode is not None or self.monitor in MONITOR_MODES, "train.monitor", self.monitor,
                f"{', '.join(MONITOR_MODES)}, or any metric of the recipe's with train.monitor_mode=min|max (which way "
                "is better)")


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


class WandbMode(Enum):
    online = "online"
    offline = "offline"  # written under the run directory; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class CsvLoggerConfig:
    file: str = "metrics.csv"  # in the run directory: every step's record, numbers only, units in the column names


@dataclass
class TensorBoardLoggerConfig:
    log_dir: str = "tensorboard"  # inside the run directory (relative): a tracker writes only its own run's files


@dataclass
class WandbLoggerConfig:
    project: str = "ampctl"
    entity: Optional[str] = None  # null: the logged-in user's default
    mode: Optional[WandbMode] = None  # null: wandb's own choice (WANDB_MODE, else online)
    name: Optional[str] = None  # null: the run directory's name
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowLoggerConfig:
    tracking_uri: Optional[str] = None  # null: MLflow's own (MLFLOW_TRACKING_URI, else its local default)
    experiment: str = "ampctl"
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class LoggerConfig:
    """Experiment trackers, any number at once (`logger=[tensorboard,csv]`): each ampctl/conf/logger/<name>.yaml
    turns its node on; a null node is off."""

    csv: Optional[CsvLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None


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
    logger: LoggerConfig = safe_to_change(default_factory=LoggerConfig)
    # a run dir or checkpoint file to continue from; "auto": this run dir's newest
    resume: Optional[str] = safe_to_change(None)


@dataclass
class CompareConfig:
    # null: every mode this device runs at speed among DEFAULT_COMPARE_PRECISIONS
    precisions: Optional[list[str]] = None
    warmup_steps: int = 10  # steps left out of each mode's timings
    # the modes take turns in this many rounds after the warm-up (each a window of steps of every mode, one mode at
    # a time): each mode's step time is the median of its rounds, its speedup has an interval; 1: one after another
    rounds: int = 5
    # each mode trains with this many seeds (train.seed, +1, ...): accuracy parity with fp32 is judged against the
    # seed-to-seed noise (reports/parity.py); the seeds' rounds all count in the timings
    seeds: int = 1
    # [false,true]: each mode without and with activation checkpointing (rows "bf16", "bf16+ac")
    activation_checkpointing: Optional[list[bool]] = None
    # [false,true]: each mode eager and compiled (rows "bf16", "bf16+compile"); null: [train.compile], one
    # setting for every mode, so that no mode is credited with compile's gain
    compile: Optional[list[bool]] = None

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "compare.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.rounds >= 1, "compare.rounds", self.rounds, "an integer >= 1")
        require(self.seeds >= 1, "compare.seeds", self.seeds, "an integer >= 1")


# The modes `ampctl compare` runs when compare.precisions is null (those the device can run).
DEFAULT_COMPARE_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "O2")


@dataclass
class CompareAppConfig(AmpctlConfig):
    """The primary config of `ampctl compare`: a train config plus what to compare."""

    compare: CompareConfig = field(default_factory=CompareConfig)


@dataclass
class MemoryConfig:
    precisions: Optional[list[str]] = None  # null: the run's own precision= only
    activation_checkpointing: Optional[list[bool]] = None  # e.g. [false,true]; null: train.activation_checkpointing
    budget: Optional[str] = None  # e.g. 80GB or 16GiB: the largest batch that fits, per mode
    steps: int = 2  # measured steps; the first allocates the optimizer's states
    timed_steps: int = 3  # more steps after the measured ones, timed (activation checkpointing's cost)
    search: Optional[bool] = None  # verify the batch estimate with real steps; null: on CUDA

    def __post_init__(self) -> None:
        require(self.steps >= 1, "memory.steps", self.steps, "an integer >= 1")
        require(self.timed_steps >= 0, "memory.timed_steps", self.timed_steps, "an integer >= 0")


@dataclass
class MemoryAppConfig(AmpctlConfig):
    """The primary config of `ampctl memory`: a train config plus what to measure."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class InspectConfig:
    steps: int = 3  # training steps recorded
    loss_scale: Optional[float] = None  # the loss scale studied; null: the mode's scaler's, else 65536

    def __post_init__(self) -> None:
        require(self.steps >= 1, "inspect.steps", self.steps, "an integer >= 1")


@dataclass
class InspectAppConfig(AmpctlConfig):
    """The primary config of `ampctl inspect`: a train config plus what to inspect."""

    inspect: InspectConfig = field(default_factory=InspectConfig)


class AdviseGoal(Enum):
    speed = "speed"  # the fastest mode whose accuracy matches fp32's
    memory = "memory"  # the mode with the smallest peak whose accuracy matches fp32's
    accuracy = "accuracy"  # fp32's numbers: the others as alternatives, with what they would cost


@dataclass
class AdviseConfig:
    budget: str = "10min"  # the time advise may take in all: 90s, 10min, 1h30m
    goal: AdviseGoal = AdviseGoal.speed
    name: str = "advised"  # the experiment config it writes: <run dir>/<name>.yaml
    # torch.compile measured (each mode eager and compiled): null, where the budget leaves each run enough steps
    # after the compile time the calibration measured; true, always; false, never
    compile: Optional[bool] = None
    # FP8 and MX modes: a layer whose format loses more than this share of an operand's values (saturated or
    # flushed to zero, as inspect counts them in that mode) stays unconverted
    layer_loss_limit: float = 0.02

    def __post_init__(self) -> None:
        require(budget_seconds(self.budget) is not None, "advise.budget", self.budget,
                "a duration such as 90s, 10min, 1h or 1h30m")
        require(0.0 <= self.layer_loss_limit < 1.0, "advise.layer_loss_limit", self.layer_loss_limit,
                "a share of values from 0 to below 1 (0.02: 2%)")
        require(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name)), "advise.name", self.name,
                "a config name: letters, digits and _")


def budget_seconds(text: str) -> Optional[float]:
    """'1h30m' -> 5400.0; None when it is no duration (a positive one of h, min or m, s)."""
    number = r"(\d+(?:\.\d+)?)"
    match = re.fullmatch(rf"\s*(?:{number}\s*h)?\s*(?:{number}\s*(?:min|m))?\s*(?:{number}\s*s)?\s*", str(text))
    if match is None or not any(match.groups()):
        return None
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    return total if total > 0 else None


@dataclass
class AdviseAppConfig(AmpctlConfig):
    """The primary config of `ampctl advise`: a train config, what to advise on, and the settings of the compare
    and inspect studies it runs."""

    advise: AdviseConfig = field(default_factory=AdviseConfig)
    compare: CompareConfig = field(default_factory=lambda: CompareConfig(seeds=3, rounds=3, warmup_steps=5))
    inspect: InspectConfig = field(default_factory=lambda: InspectConfig(steps=2))


SCALER_SCHEMAS = {"none": NoScalerConfig, "static": StaticScalerConfig, "dynamic": DynamicScalerConfig}


def scaler_is_active(scaler: DictConfig) -> bool:
    """Whether this scaler config scales losses and skips non-finite steps: static, or dynamic and enabled
    (scaler.enabled=false is GradScaler's identity, the same as scaler=none)."""
    return scaler.kind == "static" or (scaler.kind == "dynamic" and scaler.enabled)


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


# command -> the name its primary config (ampctl/conf/<command>.yaml) extends, and the schema stored under it
APP_SCHEMAS: dict[str, tuple[str, type]] = {
    "train": ("ampctl_schema", AmpctlConfig),
    "compare": ("ampctl_compare_schema", CompareAppConfig),
    "memory": ("ampctl_memory_schema", MemoryAppConfig),
    "inspect": ("ampctl_inspect_schema", InspectAppConfig),
    "advise": ("ampctl_advise_schema", AdviseAppConfig),
}


def register_configs(command: Optional[str] = None) -> None:
    """Store the schemas in Hydra's ConfigStore: every command's, or those `command` composes (its own app
    schema, and train's, which its modes and probes compose). Called explicitly by the router and by tests.
    The router stores one command's only: Hydra's --help and shell completion deep-copy the whole store once per
    config group they list, and each app schema stored beside cost `ampctl train --help` ~0.1 s."""
    cs = ConfigStore.instance()
    for name, (stored_as, node) in APP_SCHEMAS.items():
        if command is None or name in ("train", command):
            cs.store(name=stored_as, node=node)
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
            keys.append(f"{prefix}{f.name}{'.' if node else ''}")
        elif node:
            keys += safe_to_change_keys(hints[f.name], f"{prefix}{f.name}.")
    return tuple(keys)
