"""Config schemas: one source of defaults and types, plus the range checks OmegaConf cannot express.

Every YAML in ampctl/conf/ extends one of the schemas stored here (``defaults: [/schema_<group>[_<kind>]@_here_]``):
the run's (telemetry.*, distributed.*, guard.*) are defined in this module, train.* and its groups in
train_schema.py, a precision mode's and its scaler's in precision_schema.py; a study command's own (compare.*,
diff.*, ...) and its primary config in its command's module (ampctl/commands/<name>.py); a tracker's options are its
class's (runner/trackers/);
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

from ampctl.conf.fields import safe_to_change
from ampctl.conf.precision_schema import SCALER_SCHEMAS, PrecisionConfig
from ampctl.conf.train_schema import TrainConfig
from ampctl.conf.value_checks import positive_finite, require
from ampctl.errors import UsageError


class DeviceChoice(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class TelemetryConfig:
    # every N steps, record per-layer value ranges into ranges.jsonl (ampctl inspect's)
    ranges_every: Optional[int] = None
    # every N steps, per block-scaled layer (MXFP8, MXFP4, NVFP4) and operand, its block scales' figures into
    # blocks.jsonl and the trackers (analysis/block_scales.BlocksLog)
    blocks_every: Optional[int] = None
    # every N steps, a mixture of experts' load (each expert's share of the tokens, the busiest's over the mean) into
    # experts.jsonl, the trackers and the live line (analysis/expert_load.py); null: on every log step
    experts_every: Optional[int] = None
    # on a CPU, measure peak memory with torch's memory profiler over the build and steps 1-2 (well under 1 s);
    # on CUDA the allocator's peak is always read, for free
    profile_cpu_memory: bool = safe_to_change(True)

    def __post_init__(self) -> None:
        for key in ("ranges_every", "blocks_every", "experts_every"):
            every = getattr(self, key)
            require(every is None or every >= 1, f"telemetry.{key}", every, "an integer >= 1, or null")


class ParallelKind(Enum):
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"


class AsyncCheckpointer(Enum):
    """What writes an async sharded checkpoint while training goes on (DCP's async_checkpointer_type's names)."""

    thread = "thread"  # DCP's async_save in a thread of the training process (contends with training for the GIL)
    process = "process"  # a process of its own on each rank (runner/checkpointing/checkpoint_process.py)


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
    # sharded: the state is copied to CPU memory and written in the background while training goes on, by
    # async_checkpointer: a thread of the training process, or (distributed runs) a process of its own on each rank
    async_checkpoint: bool = False
    async_checkpointer: AsyncCheckpointer = AsyncCheckpointer.thread

    def __post_init__(self) -> None:
        require(self.timeout_s >= 1, "distributed.timeout_s", self.timeout_s, "an integer >= 1")
        require(not self.async_checkpoint or self.checkpoint_format == CheckpointFormat.sharded,
                "distributed.async_checkpoint", self.async_checkpoint,
                "false with distributed.checkpoint_format=full (async saves are sharded ones)")
        process = self.async_checkpointer is AsyncCheckpointer.process
        require(not process or self.async_checkpoint, "distributed.async_checkpointer", "process",
                "thread unless distributed.async_checkpoint=true (it says what writes an async checkpoint)")
        require(not process or self.kind is not ParallelKind.none, "distributed.async_checkpointer", "process",
                "thread without a distributed run (distributed=ddp or fsdp under torchrun): the saving processes "
                "meet as the ranks do")


class NonfiniteAction(Enum):
    stop = "stop"
    warn = "warn"


class TripAction(Enum):
    stop = "stop"  # the run stops, the step replayed to name the layer (diagnosis.json)
    # back to the newest good checkpoint, the named layer(s) one step up: runner/guarding/escalation.py
    escalate = "escalate"


@dataclass
class GuardConfig:
    """Checked on log steps (when values come back from the device anyway): never a per-step sync."""

    max_consecutive_skips: Optional[int] = 100  # this many skipped steps in a row stop the run; null: never
    stop_at_min_scale: bool = True  # an overflow at scaler.min_scale stops the run: it cannot back off further
    on_nonfinite: NonfiniteAction = NonfiniteAction.stop  # stop | warn, for a non-finite loss no scaler can absorb
    # a finite loss spike stops the run: a step's loss more than this many robust deviations (1.4826 x the median
    # absolute deviation, at least 1% of the median) above the median of the last loss_spike_window steps' losses,
    # checked once that many are in (its warm-up); null: not watched (Lightning's SpikeDetection, llm-foundry's
    # idea). A watch, not the run's numerics: a resumed run may start or change it
    loss_spike: Optional[float] = safe_to_change(None)
    loss_spike_window: int = safe_to_change(50)
    # what a trip does: stop, or escalate: go back to the newest good checkpoint, raise the precision of the
    # layer(s) the replay names (or, where nothing is non-finite, the one adding the largest error against fp32),
    # and continue, at most max_escalations times in the run, then stop. A reaction, not the run's numerics: its
    # escalations are recorded as the run's scheduled rule changes (escalations.jsonl), which a resume keeps
    on_trip: TripAction = safe_to_change(TripAction.stop)
    max_escalations: int = safe_to_change(3)

    def __post_init__(self) -> None:
        if self.max_consecutive_skips is not None:
            require(self.max_consecutive_skips >= 1, "guard.max_consecutive_skips", self.max_consecutive_skips,
                    "an integer >= 1, or null to never stop on skipped steps")
        if self.loss_spike is not None:
            require(positive_finite(self.loss_spike), "guard.loss_spike", self.loss_spike,
                    "a number of robust deviations > 0 (6: far out of the loss's own wiggle), or null for none")
        require(self.max_escalations >= 1, "guard.max_escalations", self.max_escalations,
                "an integer >= 1 (the escalations a run may make before it stops as guard.on_trip=stop does)")
        require(self.loss_spike_window >= 10, "guard.loss_spike_window", self.loss_spike_window,
                "an integer >= 10 (the steps whose median and spread a spike is measured against)")


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
    require(not (cfg.train.checkpoint.save_top_k and cfg.distributed.checkpoint_format == CheckpointFormat.sharded),
            "train.checkpoint.save_top_k", cfg.train.checkpoint.save_top_k,
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
