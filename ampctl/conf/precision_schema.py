"""The schemas of a precision mode (precision.*: autocast, dtypes, converters' formats, per-layer rules) and of
its loss scaler (scaler.*): the types and defaults their YAMLs in ampctl/conf/precision/ and ampctl/conf/scaler/
extend, with their range checks (see conf/schema.py)."""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping, Optional

from omegaconf import MISSING, DictConfig

from ampctl.conf.fields import safe_to_change
from ampctl.conf.value_checks import LOSS_SCALE_ALLOWED, loss_scale_ok, require, yaml_text


class Dtype(Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


LAYER_DTYPES = ("fp32", "bf16", "fp16")  # what a rule may keep a layer's math in, besides a converter's formats
UNCONVERTED = "unconverted"  # a rule's run_in that leaves its layers out of the mode's converter


_FROM_THE_END = re.compile(r"-(\d+)")  # a numeric segment of a rule's match, counted from the end


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

    @classmethod
    def for_layer(cls, name: str, run_in: str) -> "LayerRule":
        """The rule for one layer by its qualified name (escaped: a name is not a glob)."""
        return cls(run_in=run_in, match=glob.escape(name))

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> "LayerRule":
        """From a config's or a record's rule (a dict, a DictConfig)."""
        return cls(run_in=str(data["run_in"]), match=data.get("match"), type=data.get("type"))

    def counted_from_the_end(self, names: Iterable[str]) -> "LayerRule":
        """The rule with its match's numeric segment written from the end (`blocks.-1.*`: the last of the blocks, as
        Python indexes; `model.layers.-2.mlp.*`) resolved against the model's names, numerically, so that one rule
        keeps the last blocks high whatever the depth (NVFP4's recipe keeps its last blocks in bf16). Unresolved where
        no such index exists: the rule then matches nothing and is refused with the closest names."""
        if not self.match or "-" not in self.match:
            return self
        parts = self.match.split(".")
        for position, part in enumerate(parts):
            wanted = _FROM_THE_END.fullmatch(part)
            if wanted is None:
                continue
            prefix = ".".join(parts[:position])
            indices = sorted({int(split[position]) for name in names if len(split := name.split(".")) > position
                              and split[position].isdigit()
                              and fnmatch.fnmatchcase(".".join(split[:position]), prefix)})
            if not 1 <= int(wanted.group(1)) <= len(indices):
                return self
            parts[position] = str(indices[-int(wanted.group(1))])
        return dataclasses.replace(self, match=".".join(parts))

    def as_record(self) -> dict[str, str]:
        """As ampctl's records (diff.json, advice.json, escalations.jsonl) hold it: the keys that are set."""
        return {key: value for key, value in (("match", self.match), ("type", self.type), ("run_in", self.run_in))
                if value is not None}

    def override(self) -> str:
        """As an element of a `precision.rules=[...]` override: {match:'head',run_in:'fp32'}."""
        return "{" + ",".join(f"{key}:'{value}'" for key, value in self.as_record().items()) + "}"


@dataclass
class ScheduledChange:
    """A change of precision.schedule (conf/precision_schedule.py): from a point of the run on, it trains in another
    mode and/or with other rules, as NVFP4's recipe ends in bf16: `precision.schedule=[{at: 0.82, precision: bf16}]`.
    Each change says the whole of what follows it: its mode (the run's own where it names none), its rules before
    that mode's own."""

    at: Optional[float] = None  # a fraction of train.steps in (0, 1): the change holds from the step after the
    # nearest one (at=0.82 of 100 steps: from step 83 on)
    step: Optional[int] = None  # or a step: the change holds from the step after it
    precision: Optional[str] = None  # a mode of the precision group (bf16, a -cd directory's own)
    rules: Optional[list[LayerRule]] = None  # per-layer rules before the mode's own from then on
    # filled when the run is planned, not by hand: `precision`'s node as Hydra composes it, recorded with the run
    # so that a resume trains in the mode the run began with, whatever the YAML says by then
    mode: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        require((self.at is None) != (self.step is None), "precision.schedule[].at", self.at,
                "a fraction of train.steps in (0, 1), or give step= instead (one of the two)")
        if self.at is not None:
            require(0.0 < self.at < 1.0, "precision.schedule[].at", self.at, "a fraction of train.steps in (0, 1)")
        if self.step is not None:
            require(self.step >= 1, "precision.schedule[].step", self.step, "an integer >= 1")
        require(self.precision is not None or self.rules is not None, "precision.schedule[].precision", None,
                "a precision mode to change to (precision: bf16), or rules: [...] (a change needs one)")


def rules_of(precision: Any) -> list[LayerRule]:
    """A composed precision config's rules (precision.rules, its defaults included)."""
    return [LayerRule.of(rule) for rule in precision.get("rules") or []]


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
    # The model converter of a converter-style mode (ampctl/engine/precision/converters.py): its registered name,
    # or its dotted path (a module of one's own beside one's configs).
    converter: Optional[str] = None
    # The converter's options: the keys of its options dataclass (Converter.options_type, beside the converter),
    # each at its default in the mode's YAML so that a command line sets one without `+`; typed by the converter
    # when the run is planned.
    options: Optional[dict[str, Any]] = None
    rules: list[LayerRule] = field(default_factory=list)  # per-layer precision, first match wins (O2: norms in fp32)
    # the type micro-batch gradients add up in (train.grad_accum_steps > 1) where weights are half (O2's model, O3,
    # bf16_true): null, the weights' own; float32, an fp32 gradient per parameter (O2: its master's; otherwise a
    # buffer, 4 bytes a parameter) rounded once into the half one the optimizer steps from (engine/precision/half.py).
    # A buffer within a step, not the run's state: a resumed run may change it
    grad_accum_dtype: Optional[str] = safe_to_change(None)
    # changes of mode or rules at points of the run (conf/precision_schedule.py); a resumed run may change the
    # ones still ahead of it (those it trained through are checked unchanged when it is planned)
    schedule: list[ScheduledChange] = safe_to_change(default_factory=list)

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
        require(self.grad_accum_dtype in (None, "float32"), "precision.grad_accum_dtype", self.grad_accum_dtype,
                "float32 (an fp32 gradient per parameter), or null for the weights' own type")


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


SCALER_SCHEMAS = {"none": NoScalerConfig, "static": StaticScalerConfig, "dynamic": DynamicScalerConfig}


def scaler_is_active(scaler: DictConfig) -> bool:
    """Whether this scaler config scales losses and skips non-finite steps: static, or dynamic and enabled
    (scaler.enabled=false is GradScaler's identity, the same as scaler=none)."""
    return scaler.kind == "static" or (scaler.kind == "dynamic" and scaler.enabled)
