"""train.*'s schema: the loop's own keys, and a group per concern (train.lr, train.checkpoint, train.eval, train.ema,
train.cluster, train.compile), each the one place for its defaults and checks, as torchtitan gives each component
its own config. A run recorded before the groups (flat keys: train.checkpoint_every, train.compile_mode, ...) is read
through conf/migration.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from ampctl.conf.fields import safe_to_change
from ampctl.conf.value_checks import positive_finite, require


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


# the eval metrics whose better direction goes without saying (train.checkpoint.monitor_mode: null)
MONITOR_MODES = {"loss": "min", "perplexity": "min", "accuracy": "max"}
EMA_METRIC = "ema_"  # the prefix of a metric of the weight average's (train.ema.decay): eval/ema_loss


def monitor_direction(monitor: str) -> Optional[str]:
    """min | max for a metric whose better direction goes without saying (the average's as the model's), else None."""
    return MONITOR_MODES.get(monitor.removeprefix(EMA_METRIC))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


@dataclass
class LrConfig:
    """train.lr.*: the learning-rate schedule around optimizer.lr."""

    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 20
    min_ratio: float = 0.1  # cosine/linear decay ends at lr * min_ratio

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "train.lr.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(0.0 <= self.min_ratio <= 1.0, "train.lr.min_ratio", self.min_ratio, "a number in [0, 1]")


@dataclass
class CheckpointConfig:
    """train.checkpoint.*: when checkpoints are written, how many are kept, where they are mirrored, and the best."""

    every: Optional[int] = safe_to_change(None)  # steps between checkpoints; one is always at the end
    # seconds between checkpoints, checked on log steps (every rank decides together there): a crash loses at
    # most this much of a long run whatever `every` says; null: by steps only
    every_s: Optional[float] = safe_to_change(1800.0)
    keep: int = safe_to_change(2)  # the newest K checkpoints are kept
    # an fsspec URL (s3://bucket/run, gs://..., memory://...) each checkpoint is uploaded to as well, its checksum
    # last; resume=auto in an empty run directory pulls the newest that verifies (runner/checkpointing/mirror.py).
    # null: none
    mirror: Optional[str] = safe_to_change(None)
    # the mirror's fsspec storage_options, as its file system takes them (s3fs: endpoint_url, profile, client_kwargs,
    # config_kwargs={retries: {max_attempts: 10}}; gcsfs: project, token): retries and endpoints are the library's
    mirror_options: Dict[str, Any] = safe_to_change(default_factory=dict)
    # the K best checkpoints by the eval metric `monitor`, in checkpoints/best/, beside the newest ones
    save_top_k: int = safe_to_change(0)
    monitor: str = "loss"  # an eval metric of the recipe's: loss, accuracy, perplexity, or its own
    monitor_mode: Optional[str] = None  # min | max; null: max for accuracy, min for loss and perplexity

    def __post_init__(self) -> None:
        require(self.keep >= 1, "train.checkpoint.keep", self.keep, "an integer >= 1")
        if self.every is not None:
            require(self.every >= 1, "train.checkpoint.every", self.every,
                    "an integer >= 1, or null for a checkpoint at the end only")
        if self.every_s is not None:
            require(positive_finite(self.every_s), "train.checkpoint.every_s", self.every_s,
                    "a number of seconds > 0, or null for checkpoints by steps only")
        require(self.save_top_k >= 0, "train.checkpoint.save_top_k", self.save_top_k, "an integer >= 0")
        require(self.monitor_mode in (None, "min", "max"), "train.checkpoint.monitor_mode", self.monitor_mode,
                "min | max | null")
        require(self.monitor_mode is not None or monitor_direction(self.monitor) is not None,
                "train.checkpoint.monitor", self.monitor,
                f"{', '.join(MONITOR_MODES)}, or any metric of the recipe's with train.checkpoint.monitor_mode=min|max "
                "(which way is better); the weight average's with ema_ before them")


@dataclass
class EvalConfig:
    """train.eval.*: evaluation on the recipe's held-out batches after every N steps and after the last, under the
    run's autocast (engine/evaluation.py): evals.jsonl, the summary, the trackers, a line each."""

    every: Optional[int] = safe_to_change(None)  # null: no evaluation
    batches: int = safe_to_change(8)  # held-out batches per evaluation
    fp32: bool = safe_to_change(False)  # each evaluation in fp32 too (autocast off; an fp32 copy of O2/O3's model)

    def __post_init__(self) -> None:
        require(self.every is None or self.every >= 1, "train.eval.every", self.every,
                "an integer >= 1, or null for no evaluation")
        require(self.batches >= 1, "train.eval.batches", self.batches, "an integer >= 1")


@dataclass
class EmaConfig:
    """train.ema.*: an fp32 exponential moving average of the weights (engine/weight_average.py), evaluated beside
    the model (eval/ema_<metric>), checkpointed. It is the weights at start_step, then moves toward them after
    every `every`-th step."""

    decay: Optional[float] = None  # null: no average
    start_step: int = 0
    every: int = 1

    def __post_init__(self) -> None:
        if self.decay is not None:
            require(0.0 < self.decay < 1.0, "train.ema.decay", self.decay,
                    "a number in (0, 1) (0.999: an average over ~1000 steps), or null for no weight average")
        require(self.start_step >= 0, "train.ema.start_step", self.start_step, "an integer >= 0")
        require(self.every >= 1, "train.ema.every", self.every, "an integer >= 1")


@dataclass
class ClusterConfig:
    """train.cluster.*: what a batch system's job does on its warnings, and a hang's detection."""

    # treated as SIGTERM is: finish the step, checkpoint, exit 128 + its number (138 for SIGUSR1); null: ignore it
    preempt_signal: Optional[PreemptSignal] = safe_to_change(PreemptSignal.SIGUSR1)
    # in a SLURM job, the preemption signal also requeues the job (scontrol requeue) once the checkpoint is
    # written; the requeued job continues with resume=auto (Lightning's auto_requeue)
    slurm_requeue: bool = safe_to_change(True)
    # hang detection: no step finished for this many seconds (and 20x the median step) is said, with every
    # thread's stack in hang-step-N.txt; the run goes on (runner/watchdog.py). null: off
    hang_after_s: Optional[float] = safe_to_change(300.0)

    def __post_init__(self) -> None:
        if self.hang_after_s is not None:
            require(positive_finite(self.hang_after_s), "train.cluster.hang_after_s", self.hang_after_s,
                    "a number of seconds > 0, or null for no hang detection")


@dataclass
class CompileConfig:
    """train.compile.*: torch.compile of each block the recipe names (as torchtitan compiles each transformer
    block), else of the whole model (engine/compilation.py); its first steps are left out of the timings."""

    enabled: bool = safe_to_change(False)
    mode: str = safe_to_change("default", choices=COMPILE_MODES)  # torch.compile's mode

    def __post_init__(self) -> None:
        require(self.mode in COMPILE_MODES, "train.compile.mode", self.mode,
                f"one of torch.compile's modes: {', '.join(COMPILE_MODES)}")


@dataclass
class LayerErrorWatchConfig:
    """train.diff.*: every N steps, each layer's error against fp32 at the run's current weights (`ampctl diff`'s
    measurement, on the first `batches` batches of train.seed, the same each time): diffs.jsonl, and a layer-by-step
    heatmap in the run's report (runner/layer_error_log.py). Where a layer starts to drift, without a rerun."""

    every: Optional[int] = None  # null: off
    batches: int = 2  # the gradient's noise is measured across them

    def __post_init__(self) -> None:
        require(self.every is None or self.every >= 1, "train.diff.every", self.every,
                "an integer >= 1, or null for none")
        require(self.batches >= 2, "train.diff.batches", self.batches,
                "an integer >= 2 (the yardstick is the gradient's spread from batch to batch)")


@dataclass
class TrainConfig:
    """train.*: the loop, and a group per concern (lr, checkpoint, eval, ema, cluster, compile), each the one place
    for its defaults and checks. safe_to_change(...): a resumed run may change it."""

    steps: int = safe_to_change(200)
    grad_accum_steps: int = 1
    clip_grad_norm: Optional[float] = 1.0  # max total grad norm after unscale_; null = no clipping
    log_every: int = safe_to_change(10)  # the only steps that read values back from the device
    seed: int = 0
    timing_warmup_steps: int = safe_to_change(5)  # first steps left out of median step time and throughput
    console: ConsoleMode = safe_to_change(ConsoleMode.auto)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (gpt, resnet)
    # the same config, the same bits: torch's deterministic algorithms (an op without one is refused in one line),
    # cuDNN's deterministic kernels, cuBLAS's fixed workspace (engine/determinism.py). Kernels, not the model: a
    # resumed run may turn it on or off
    deterministic: bool = safe_to_change(False)
    # torch's intra-op threads (torch.set_num_threads); null: torch's own choice, one per core. compare sizes them to
    # the cores other processes leave free (a step waits for whichever thread the scheduler set aside)
    threads: Optional[int] = safe_to_change(None)
    # on a CPU, glibc's malloc keeps what each step frees instead of returning it to the kernel and faulting it back
    # in on the next step (engine/host_memory.py: 5-13% of a small GPT's step here); the process's memory stays at
    # its peak, for the process's life. false: glibc's defaults
    hold_host_memory: bool = safe_to_change(True)
    # N: a torch.profiler trace of N steady steps (after the timing warm-up) in the run's profile/, and a summary
    # of where their time went (matmuls, other ops, optimizer, data, ...); null: no profiler
    profile: Optional[int] = safe_to_change(None)
    lr: LrConfig = field(default_factory=LrConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    diff: LayerErrorWatchConfig = safe_to_change(default_factory=LayerErrorWatchConfig)  # a watch: may change

    def __post_init__(self) -> None:
        for key in ("steps", "grad_accum_steps", "log_every"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "an integer >= 1")
        require(self.timing_warmup_steps >= 0, "train.timing_warmup_steps", self.timing_warmup_steps,
                "an integer >= 0")
        if self.threads is not None:
            require(self.threads >= 1, "train.threads", self.threads, "an integer >= 1, or null for one per core")
        require(self.profile is None or self.profile >= 1, "train.profile", self.profile,
                "a number of steps >= 1, or null for no profile")
        if self.clip_grad_norm is not None:
            require(positive_finite(self.clip_grad_norm), "train.clip_grad_norm", self.clip_grad_norm,
                    "a finite number > 0, or null for no clipping")
        # across groups: the best checkpoints are ranked by an evaluation, the average's metrics need an average
        require(self.checkpoint.save_top_k == 0 or self.eval.every is not None, "train.checkpoint.save_top_k",
                self.checkpoint.save_top_k, "0 without train.eval.every (the best checkpoints are ranked by an "
                "evaluation)")
        require(not self.checkpoint.monitor.startswith(EMA_METRIC) or self.ema.decay is not None,
                "train.checkpoint.monitor", self.checkpoint.monitor,
                "a metric of the model's without train.ema.decay (the weight average's metrics need one)")
