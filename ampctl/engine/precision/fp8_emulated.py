"""Emulated FP8 training (precision=fp8_emulated): every nn.Linear's matmul inputs are quantized to FP8 and
back (torch's float8_e4m3fn / float8_e5m2 dtypes), the matmul itself runs in fp32, gradients flow straight
through the quantizers. Slow by design: it exists to study FP8's convergence and error on any machine.

Scaling granularities (fp8.scaling), each after its reference implementation:
- current: one scale per tensor from its own amax, this step: torchao's "tensorwise" (amax_to_scale: the
  scale is computed in float64 from an amax clamped at 1e-12, then cast to fp32), bit for bit.
- delayed: Transformer Engine's DelayedScaling. Each tensor role of each layer keeps an amax history (this
  step's amax and the amax_history_len - 1 before it) and a scale. A step quantizes with the scale computed
  after the previous step (1.0 on the first, as TE starts), then records its amax and computes the next
  scale from the history (its max, or the most recent entry) with TE's rule: fp8_max / amax / 2^margin in
  fp32; an amax of 0 or a non-finite one keeps the previous scale; an infinite scale becomes fp32's max.
- blockwise: DeepSeek-V3's fine-grained scaling, E4M3 only: one scale per 1x128 tile of activations and
  gradients along the reduction dimension of the matmul they enter, one per 128x128 block of weights. The
  weight-gradient matmul reduces over tokens, so there the activations and gradients are quantized again
  in 128x1 tiles (128 tokens of one feature), as Transformer Engine's Float8BlockScaling quantizes its
  columnwise copies. Scales as torchao computes them (float64, amax >= 1e-12), in fp32 (TE's
  Float8BlockScaling rounds them down to powers of two by default; DeepSeek-V3's are fp32).
A margin (fp8.margin) maps amax to the format's max divided by 2^margin, as TE's margin does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.conf.value_checks import require
from ampctl.engine.precision.converters import ConvertedLinear, Converter, register_converter
from ampctl.engine.precision.grouped_experts import PerExpertLinear, is_grouped_experts, mix_into
from ampctl.errors import UsageError


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
class Fp8EmulatedOptions:
    """Emulated FP8 for every Linear's matmul inputs (ampctl/engine/precision/fp8_emulated.py)."""

    # current (per tensor, this step) | delayed (amax history, TE) | blockwise (DeepSeek-V3, e4m3 only)
    scaling: Fp8Scaling = Fp8Scaling.current
    format: Fp8Format = Fp8Format.hybrid  # hybrid: e4m3 forward, e5m2 gradients | e4m3
    amax_history_len: int = 16  # delayed scaling
    amax_compute_algo: AmaxAlgo = AmaxAlgo.max  # delayed scaling: max | most_recent
    margin: int = 0  # scales map amax to the format's max / 2^margin

    def __post_init__(self) -> None:
        require(self.amax_history_len >= 1, "precision.options.amax_history_len", self.amax_history_len,
                "an integer >= 1")
        require(self.margin >= 0, "precision.options.margin", self.margin, "an integer >= 0")
        require(not (self.scaling is Fp8Scaling.blockwise and self.format is Fp8Format.hybrid),
                "precision.options.format", self.format.name,
                "e4m3 with scaling=blockwise (DeepSeek-V3's fine-grained scaling is E4M3 only)")


E4M3 = torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else None
E5M2 = torch.float8_e5m2 if hasattr(torch, "float8_e5m2") else None
TILE = 128  # DeepSeek-V3's tile (1x128) and block (128x128) edge
AMAX_EPS = 1e-12  # torchao's floor on an amax: a tiny or all-zero tensor gets a large finite scale, never inf
FP32_MAX = torch.finfo(torch.float32).max


def backward_dtype(config: Fp8EmulatedOptions) -> torch.dtype:
    """The gradients' FP8 type: e5m2 in the hybrid format, e4m3 otherwise (blockwise is e4m3 only)."""
    return E5M2 if config.format is Fp8Format.hybrid and config.scaling is not Fp8Scaling.blockwise else E4M3


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x * scale cast to FP8 (saturating at the format's max) and back, divided by scale, in fp32: torchao's
    hp_tensor_and_scale_to_float8 followed by its dequantization."""
    limit = _fp8_max(dtype)
    scaled = (x.float() * scale).clamp(-limit, limit)
    return scaled.to(dtype).float() / scale


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """torchao's amax_to_scale: fp8_max / max(amax, 1e-12) in float64, cast to fp32 (correctly rounded, and
    the same in eager and compiled code); divided by 2^margin, exactly, for TE's margin."""
    scale = _fp8_max(dtype) / amax.double().clamp(min=AMAX_EPS)
    return (scale / 2.0**margin).float()


def delayed_scale(amax: torch.Tensor, previous: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """Transformer Engine's _default_sf_compute, in fp32 as TE computes it."""
    scale = _fp8_max(dtype) / amax.float() / 2.0**margin
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, previous)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    return quantize(x, dtype, scale_from_amax(x.detach().abs().max(), dtype, margin))


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype, rows: int, cols: int, margin: int = 0) -> torch.Tensor:
    """One scale per rows x cols tile of x viewed as a matrix (its last dimension the columns): 1x128 tiles
    along the columns, 128x1 along the rows, 128x128 blocks."""
    shape = x.shape
    matrix = x.reshape(-1, shape[-1])
    r, c = matrix.shape
    pad_r, pad_c = (-r) % rows, (-c) % cols
    padded = F.pad(matrix.float(), (0, pad_c, 0, pad_r))
    tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    amax = tiles.detach().abs().amax(dim=(1, 3), keepdim=True)
    out = quantize(tiles, dtype, scale_from_amax(amax, dtype, margin))
    return out.reshape(padded.shape)[:r, :c].reshape(shape)


class DelayedScaling:
    """Transformer Engine's delayed scaling for one tensor role of one layer. The amax history (most recent
    first) and the scale are buffers of the layer, so they are in the model's state_dict: checkpoints carry
    them and a resumed run scales exactly as the uninterrupted one. Everything stays on the device."""

    def __init__(self, layer: nn.Module, role: str, length: int, algo: AmaxAlgo | str) -> None:
        self.layer, self.algo = layer, AmaxAlgo(algo)  # its name or itself
        self.history_name, self.scale_name = f"fp8_amax_history_{role}", f"fp8_scale_{role}"
        layer.register_buffer(self.history_name, torch.zeros(length, device=layer.weight.device))
        layer.register_buffer(self.scale_name, torch.ones((), device=layer.weight.device))

    def quantize(self, x: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
        """x quantized with the current scale; then its amax joins the history and the next scale is set."""
        history, scale = getattr(self.layer, self.history_name), getattr(self.layer, self.scale_name)
        out = quantize(x, dtype, scale.clone())
        history.copy_(torch.roll(history, 1))
        history[0] = x.detach().abs().max().float()
        amax = history.max() if self.algo is AmaxAlgo.max else history[0]
        scale.copy_(delayed_scale(amax, scale, dtype, margin))
        return out


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):  # type: ignore[override]
        qx, qw, qx_for_wgrad = layer.quantize_forward(x, weight)
        ctx.save_for_backward(qx_for_wgrad, qw)
        ctx.layer, ctx.has_bias = layer, bias is not None
        out = qx @ qw.t()
        return out + bias.float() if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        qx_for_wgrad, qw = ctx.saved_tensors
        qg, qg_for_wgrad = ctx.layer.quantize_grad(grad_out)
        grad_x = qg @ qw
        grad_w = qg_for_wgrad.reshape(-1, qg.shape[-1]).t() @ qx_for_wgrad.reshape(-1, qx_for_wgrad.shape[-1])
        # the bias gradient is a sum, not a matmul: from the unquantized gradient, as torchao and TE do
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Fp8Quantizers:
    """The quantizers of one Linear layer: its activations, weight and output gradient, each in the layout
    of the matmul it enters (a tensor-wide scale serves every layout)."""

    def __init__(self, layer: nn.Linear, config: Fp8EmulatedOptions) -> None:
        self.config = config
        self.delayed = {role: DelayedScaling(layer, role, config.amax_history_len, config.amax_compute_algo)
                        for role in ("x", "w", "grad")} if config.scaling is Fp8Scaling.delayed else {}

    def _tensorwise(self, role: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.config.scaling is Fp8Scaling.delayed:
            return self.delayed[role].quantize(t, dtype, self.config.margin)
        return quantize_tensorwise(t, dtype, self.config.margin)

    def quantize_forward(self, x: torch.Tensor, w: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x for the forward matmul, w, x for the weight-gradient matmul)."""
        margin = self.config.margin
        if self.config.scaling is Fp8Scaling.blockwise:
            return (quantize_tiles(x, E4M3, 1, TILE, margin), quantize_tiles(w, E4M3, TILE, TILE, margin),
                    quantize_tiles(x, E4M3, TILE, 1, margin))
        qx = self._tensorwise("x", x, E4M3)
        return qx, self._tensorwise("w", w, E4M3), qx

    def quantize_grad(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g for the input-gradient matmul, g for the weight-gradient matmul)."""
        dtype, margin = backward_dtype(self.config), self.config.margin
        if self.config.scaling is Fp8Scaling.blockwise:
            return quantize_tiles(g, dtype, 1, TILE, margin), quantize_tiles(g, dtype, TILE, 1, margin)
        qg = self._tensorwise("grad", g, dtype)
        return qg, qg


class Fp8EmulatedLinear(ConvertedLinear):
    """An nn.Linear whose three matmuls take emulated FP8 inputs (precision=fp8_emulated, or a rule's
    run_in=fp8_emulated). Delayed scaling's amax histories and scales are its buffers (fp8_amax_history_x, ...),
    so they are in its state_dict."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, *, config: Fp8EmulatedOptions) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.config = config
        self.setup()

    def setup(self) -> None:
        self.quantizers = Fp8Quantizers(self, self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the emulation's matmuls are fp32 under any mode
            return _Fp8Linear.apply(x, self.weight, self.bias, self.quantizers).to(x.dtype)

    def extra_repr(self) -> str:
        c = self.config
        return f"{super().extra_repr()}, fp8={c.format.value} scaling={c.scaling.value}"


class Fp8Grouped(PerExpertLinear):
    """Mixed into grouped experts' class (engine/precision/grouped_experts.py): each expert's slice of each grouped
    matmul through _Fp8Linear, as an Fp8EmulatedLinear computes its three matmuls (each expert's GEMM its own
    tensor-wide or tile scales)."""

    class_prefix = "Fp8"
    ampctl_fp8: Fp8Quantizers

    def expert_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _Fp8Linear.apply(x, weight, None, self.ampctl_fp8)


@register_converter
class Fp8EmulatedConverter(Converter):
    """precision=fp8_emulated: every nn.Linear becomes an Fp8EmulatedLinear."""

    name = "fp8_emulated"
    options_type = Fp8EmulatedOptions
    formats = ("fp8_emulated",)
    emulated = True
    checkpoint_state = "delayed scaling's amax histories and scales, as buffers of each converted layer"

    def can_convert(self, module: nn.Module) -> bool:
        return type(module) is nn.Linear or is_grouped_experts(module)

    def convert(self, module: nn.Module, fqn: str, fmt: str) -> nn.Module:
        if not is_grouped_experts(module):
            return Fp8EmulatedLinear.from_linear(module, config=self.options)
        if self.options.scaling is Fp8Scaling.delayed:
            raise UsageError(f"precision.options.scaling=delayed with the grouped experts {fqn}: delayed scaling keeps "
                             "one amax history per tensor, and an expert's tensors change with its tokens each step; "
                             "use precision.options.scaling=current or blockwise")
        module.ampctl_fp8 = Fp8Quantizers(module, self.options)
        return mix_into(module, Fp8Grouped)

    def describe(self) -> str:
        f = self.options
        return f"fp8=emulated scaling={f.scaling.value} format={f.format.value} margin={f.margin}" + (
            f" amax_history_len={f.amax_history_len} amax_compute_algo={f.amax_compute_algo.value}"
            if f.scaling is Fp8Scaling.delayed else "")

    def speed_warnings(self, compiled: bool) -> list[str]:
        return ["emulates FP8 (quantize and dequantize around fp32 matmuls): slower than fp32 by design; it is for "
                "studying FP8's convergence and error, not for speed"]


def relative_error_bound(dtype: torch.dtype) -> float:
    """Round-to-nearest's relative error for normal values: half an ulp, 2^-(mantissa bits + 1)."""
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    return 2.0 ** -(mantissa_bits + 1)
