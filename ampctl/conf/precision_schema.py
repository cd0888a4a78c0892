"""The schemas of a precision mode (precision.*: autocast, dtypes, converters' formats, per-layer rules) and of
its loss scaler (scaler.*): the types and defaults their YAMLs in ampctl/conf/precision/ and ampctl/conf/scaler/
extend, with their range checks (see conf/schema.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from ampctl.conf.value_checks import LOSS_SCALE_ALLOWED, loss_scale_ok, require, yaml_text


class Dtype(Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


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


class Float8RecipeName(Enum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"


@dataclass
class Fp8TorchaoConfig:
    """Real FP8 through torchao's float8 training (ampctl/engine/precision/fp8_torchao.py)."""

    # tensorwise: one scale per tensor | rowwise: one per row (more accurate, slower)
    recipe_name: Float8RecipeName = Float8RecipeName.tensorwise
    auto_filter_small_kn: bool = True  # keep Linear layers too small to gain from FP8 in bf16 (torchao's heuristics)
    filter_fqns: list[str] = field(default_factory=list)  # keep Linear layers whose name contains one of these in bf16


class MXFormat(Enum):
    mxfp8 = "mxfp8"  # OCP MX: 8-bit elements (E4M3 or E5M2), blocks of 32, E8M0 scales
    mxfp4 = "mxfp4"  # OCP MX: E2M1 elements, blocks of 32, E8M0 scales
    nvfp4 = "nvfp4"  # NVIDIA: E2M1 elements, blocks of 16, E4M3 scales and an fp32 per-tensor scale


class MXElements(Enum):
    e4m3 = "e4m3"
    e5m2 = "e5m2"


class MXScaleMode(Enum):  # torchao's ScaleCalculationMode: how an E8M0 scale is rounded from a block's amax
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


SCALER_SCHEMAS = {"none": NoScalerConfig, "static": StaticScalerConfig, "dynamic": DynamicScalerConfig}


def scaler_is_active(scaler: DictConfig) -> bool:
    """Whether this scaler config scales losses and skips non-finite steps: static, or dynamic and enabled
    (scaler.enabled=false is GradScaler's identity, the same as scaler=none)."""
    return scaler.kind == "static" or (scaler.kind == "dynamic" and scaler.enabled)
