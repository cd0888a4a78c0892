"""Emulated FP8 training (precision=fp8_emulated): every nn.Linear's matmul inputs are quantized to FP8 and
back (torch's float8_e4m3fn / float8_e5m2 dtypes), the matmul itself runs in fp32, gradients flow straight
through the quantizers. Slow by design: it exists to study FP8's convergence and error on any machine.

Scaling granularities (fp8.scaling):
- current: one scale per tensor from its own amax, this step (torchao's "tensorwise").
- delayed: one scale per tensor from an amax history of the previous steps (Transformer Engine's
  DelayedScaling: amax_history_len, amax_compute_algo max | most_recent, margin); this step's amax then
  joins the history. The format is HYBRID (e4m3 forward, e5m2 gradients) or E4M3 everywhere (fp8.format).
- blockwise: DeepSeek-V3's fine-grained scaling, E4M3 only: one scale per 1x128 tile of activations and
  gradients (along the reduction dimension), one per 128x128 block of weights.
A scale maps the tensor's amax to the format's max divided by 2^margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else None
E5M2 = torch.float8_e5m2 if hasattr(torch, "float8_e5m2") else None
TILE = 128  # DeepSeek-V3's tile (1x128) and block (128x128) edge


@dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "current"  # current | delayed | blockwise
    format: str = "hybrid"  # hybrid (e4m3 forward, e5m2 backward) | e4m3
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0

    @property
    def backward_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" and self.scaling != "blockwise" else E4M3


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x * scale cast to FP8 (saturating at the format's max) and back, divided by scale, in fp32."""
    limit = _fp8_max(dtype)
    scaled = (x.float() * scale).clamp(-limit, limit)
    return scaled.to(dtype).float() / scale


def scale_for(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """The scale that maps amax to the format's max / 2^margin (1 where amax is 0)."""
    target = _fp8_max(dtype) / 2.0**margin
    return torch.where(amax > 0, target / amax.float().clamp(min=torch.finfo(torch.float32).tiny),
                       torch.ones_like(amax, dtype=torch.float32))


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    return quantize(x, dtype, scale_for(x.detach().abs().max(), dtype, margin))


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype, rows: int, cols: int, margin: int = 0) -> torch.Tensor:
    """One scale per rows x cols tile of the last two dimensions (1x128: rows=1; 128x128 blocks)."""
    shape = x.shape
    matrix = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    r, c = matrix.shape
    pad_r, pad_c = (-r) % rows, (-c) % cols
    padded = F.pad(matrix.float(), (0, pad_c, 0, pad_r))
    tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    amax = tiles.detach().abs().amax(dim=(1, 3), keepdim=True)
    out = quantize(tiles, dtype, scale_for(amax, dtype, margin))
    return out.reshape(padded.shape)[:r, :c].reshape(shape)


class AmaxHistory:
    """Transformer Engine's delayed scaling for one tensor role of one layer. The history is a buffer of the
    layer (most recent first), so it is in the model's state_dict: checkpoints carry it and a resumed run
    scales exactly as the uninterrupted one. Zeros mean "no history yet": the first step uses its own amax,
    as TE's first step does. Everything stays on the device."""

    def __init__(self, layer: nn.Module, role: str, length: int, algo: str) -> None:
        self.layer, self.name, self.algo = layer, f"fp8_amax_history_{role}", algo
        layer.register_buffer(self.name, torch.zeros(length, device=layer.weight.device))

    def scale_then_record(self, x: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
        history = getattr(self.layer, self.name)
        amax = x.detach().abs().max().float()
        recorded = history.max() if self.algo == "max" else history[0]
        reference = torch.where(history.max() > 0, recorded, amax)
        scale = scale_for(reference, dtype, margin)
        history.copy_(torch.roll(history, 1))
        history[0] = amax
        return scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):  # type: ignore[override]
        qx, qw = layer.quantize_forward(x, weight)
        ctx.save_for_backward(qx, qw)
        ctx.layer, ctx.has_bias = layer, bias is not None
        out = qx @ qw.t()
        return out + bias.float() if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        qx, qw = ctx.saved_tensors
        qg = ctx.layer.quantize_grad(grad_out)
        grad_x = qg @ qw
        grad_w = qg.reshape(-1, qg.shape[-1]).t() @ qx.reshape(-1, qx.shape[-1])
        grad_b = qg.reshape(-1, qg.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Fp8Quantizers:
    """The quantizers of one Linear layer: its activations, weight and output gradient."""

    def __init__(self, layer: nn.Linear, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.history = {role: AmaxHistory(layer, role, recipe.amax_history_len, recipe.amax_compute_algo)
                        for role in ("x", "w", "grad")} if recipe.scaling == "delayed" else {}

    def _tensor(self, role: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        r = self.recipe
        if r.scaling == "blockwise":
            rows, cols = (TILE, TILE) if role == "w" else (1, TILE)
            return quantize_tiles(t, dtype, rows, cols, r.margin)
        if r.scaling == "delayed":
            return quantize(t, dtype, self.history[role].scale_then_record(t, dtype, r.margin))
        return quantize_tensorwise(t, dtype, r.margin)

    def quantize_forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tensor("x", x, E4M3), self._tensor("w", w, E4M3)

    def quantize_grad(self, g: torch.Tensor) -> torch.Tensor:
        return self._tensor("grad", g, self.recipe.backward_dtype)


def convert_linears(model: nn.Module, recipe: Fp8Recipe) -> int:
    """Make every nn.Linear compute through emulated FP8. Returns how many were converted."""
    converted = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            quantizers = Fp8Quantizers(module, recipe)

            def forward(x: torch.Tensor, module: nn.Linear = module, q: Fp8Quantizers = quantizers) -> torch.Tensor:
                return _Fp8Linear.apply(x, module.weight, module.bias, q).to(x.dtype)

            module.forward = forward  # an instance attribute: parameters and state_dict unchanged
            converted += 1
    return converted


def relative_error_bound(dtype: torch.dtype) -> float:
    """Round-to-nearest's relative error for normal values: half an ulp, 2^-(mantissa bits + 1)."""
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    return 2.0 ** -(mantissa_bits + 1)
