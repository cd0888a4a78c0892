"""Block-scaled quantization, emulated in fp32 (the formats of mx_emulated.py's layers; docs/precision.md has the
tables): a matrix cut into blocks along its reduction dimension (or, for NVFP4's weights, 16x16 tiles), each block
scaled by its own scale (E8M0 for MX, E4M3 under an fp32 per-tensor scale for NVFP4), its elements rounded to the
element format (to nearest even, or stochastically) and dequantized back. Every number is computed as
torchao.prototype.mx_formats computes it (to_mx, nvfp4_quantize); tests/unit/test_mx.py compares the two bit for bit.
And the figures of one quantization (block_stats): what `ampctl inspect` and telemetry.blocks_every record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch
import torch.nn.functional as F

from ampctl.engine.precision import nvfp4_recipe


class MXScaleMode(Enum):  # torchao's ScaleCalculationMode: how an E8M0 scale is rounded from a block's amax
    floor = "floor"  # the OCP MX v1.0 specification's rule
    rceil = "rceil"  # NVIDIA's (cuBLAS, Transformer Engine)
    ceil = "ceil"
    even = "even"


E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126
E4M3_TINY = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny: NVFP4's smallest block scale
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Element:
    """An element format: its largest finite value, the exponent of its largest power of two (emax) and the
    torch dtype that rounds to it (None for E2M1, which torch cannot cast to: rounded by value here)."""

    name: str
    max: float
    emax: int
    dtype: Optional[torch.dtype]


ELEMENTS = {
    "e4m3": Element("e4m3", 448.0, 8, torch.float8_e4m3fn),
    "e5m2": Element("e5m2", 57344.0, 15, torch.float8_e5m2),
    "e2m1": Element("e2m1", 6.0, 2, None),
}


@dataclass(frozen=True)
class BlockFormat:
    """How one tensor role is quantized: its elements, the block length and the kind of block scale."""

    element: Element
    block: int
    scale: str  # "e8m0" (MX, with scale_mode) | "e4m3" (NVFP4, with an optional per-tensor fp32 scale)
    scale_mode: MXScaleMode = MXScaleMode.floor
    per_tensor_scale: bool = True
    # NVFP4's 2D weight blocks: 16x16 tiles of the matrix, whichever dimension a GEMM reduces (nvfp4_recipe.tiles)
    tiles_2d: bool = False


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, already within [-6, 6]) rounded to the nearest E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the
    even code: steps of 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; torch.round rounds half to even, and the even
    multiples of each step are exactly the even codes. NaN stays NaN."""
    a = x.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, x)


def _to_element(x: torch.Tensor, element: Element) -> torch.Tensor:
    """Round fp32 values (clamped to the element's range) to the element format, returned in fp32."""
    if element.dtype is None:
        return round_e2m1(x)
    return x.to(element.dtype).float()


def e8m0_codes(amax: torch.Tensor, element: Element, mode: MXScaleMode) -> torch.Tensor:
    """The biased E8M0 code (int32, 0..255) of each block's scale, from its amax (fp32): torchao's to_mx."""
    if mode == MXScaleMode.rceil:
        descale = amax / element.max
        normal = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        return torch.where(torch.isnan(descale), E8M0_NAN,
                           torch.where(torch.isinf(descale), 254, normal.to(torch.int32))).to(torch.int32)
    if mode == MXScaleMode.even:  # round amax to the element's mantissa width before taking its exponent
        bits = amax.view(torch.int32)
        rounded = ((bits + (1 << (23 - _mantissa_bits(element) - 1))) & (0x1FF << 23)).view(torch.float32)
        amax = torch.where(torch.isnan(amax), amax, rounded)
    bits = amax.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - E8M0_BIAS
    if mode == MXScaleMode.ceil:
        exponent = exponent + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    code = torch.clamp(exponent - element.emax, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(torch.isnan(amax), E8M0_NAN, code).to(torch.int32)


def _mantissa_bits(element: Element) -> int:
    return {"e4m3": 3, "e5m2": 2, "e2m1": 1}[element.name]


def e8m0_value(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) in fp32 (2^-127 is subnormal), NaN for code 255: torchao's get_fp_scale."""
    scale = torch.pow(torch.full_like(codes, 2.0, dtype=torch.float32), (codes - E8M0_BIAS).float())
    return torch.where(codes == E8M0_NAN, float("nan"), scale)


def _mx_scaled(blocks: torch.Tensor, element: Element, mode: MXScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks divided by their scales, not yet clamped; E8M0 codes): torchao's to_mx before its cast."""
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = e8m0_codes(amax, element, mode)
    if mode == MXScaleMode.rceil:
        reciprocal = torch.where(codes == E8M0_NAN, amax / element.max,
                                 torch.where(codes == 254, 2.0**-127,
                                             torch.where(codes == 0, 1.0, torch.exp2((E8M0_BIAS - codes).float()))))
        return blocks * reciprocal, codes
    divisor = torch.clamp((codes << 23).view(torch.float32), min=F32_MIN_NORMAL)  # code 255 reads as inf
    return blocks / divisor, codes


def quantize_mx_blocks(blocks: torch.Tensor, element: Element, mode: MXScaleMode
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements in fp32, E8M0 codes) of fp32 blocks (..., block): torchao's to_mx, number for number."""
    scaled, codes = _mx_scaled(blocks, element, mode)
    return _to_element(torch.clamp(scaled, -element.max, element.max), element), codes


def _nvfp4_scaled(blocks: torch.Tensor, tensor_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks times their reciprocal scales, not yet clamped; E4M3 block scales in fp32)."""
    block_scale = blocks.abs().amax(-1) / ELEMENTS["e2m1"].max
    if tensor_scale is None:
        scales = torch.clamp(block_scale, E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn).float()
        reciprocal = 1.0 / scales
    else:
        scales = torch.clamp(block_scale / tensor_scale, E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn).float()
        reciprocal = (1.0 / tensor_scale) / scales
    return blocks * reciprocal.unsqueeze(-1), scales


def quantize_nvfp4_blocks(blocks: torch.Tensor, tensor_scale: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 elements in fp32, E4M3 block scales in fp32) of fp32 blocks (..., 16): torchao's nvfp4_quantize."""
    scaled, scales = _nvfp4_scaled(blocks, tensor_scale)
    return round_e2m1(torch.clamp(scaled, -6.0, 6.0)), scales


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """torchao's per_tensor_amax_to_scale: amax / (448 * 6); 1.0 for an all-zero tensor (any scale gives zeros
    there, and torchao's 0 / 0 would make them NaN)."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax == 0, 1.0, amax / (E4M3_MAX * ELEMENTS["e2m1"].max))


def _blocks(matrix: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """matrix (rows, K) in fp32, zero-padded to a multiple of block along K and viewed as (rows, K/block, block)."""
    rows, k = matrix.shape
    pad = (-k) % block
    # contiguous fp32 before the blocks are viewed: inductor (CPU, torch 2.14) fails to tile a half-precision
    # transposed gradient cast and reshaped in one kernel
    matrix = matrix.float().contiguous()
    padded = F.pad(matrix, (0, pad)) if pad else matrix
    return padded.reshape(rows, -1, block), k


def fake_quantize(matrix: torch.Tensor, fmt: BlockFormat, draw: Optional[int] = None) -> torch.Tensor:
    """matrix (rows, K) quantized in blocks along K and dequantized, in fp32; draw: NVFP4's elements rounded
    stochastically with the random bits of this key (nvfp4_recipe.uniforms), else to nearest."""
    return _quantize(matrix, fmt, draw)[0]


def _quantize(matrix: torch.Tensor, fmt: BlockFormat, draw: Optional[int] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(matrix quantized and dequantized, in fp32; its blocks scaled to the element's range before the clamp)."""
    if fmt.tiles_2d:
        tiles, shape = nvfp4_recipe.tiles(matrix.detach())
        out, scaled = _nvfp4_quantized(tiles, matrix.detach(), fmt, draw)
        return nvfp4_recipe.untiles(out, shape), nvfp4_recipe.untiles(scaled, shape)
    blocks, k = _blocks(matrix.detach(), fmt.block)
    if fmt.scale == "e8m0":
        scaled, codes = _mx_scaled(blocks, fmt.element, fmt.scale_mode)
        elements = _to_element(torch.clamp(scaled, -fmt.element.max, fmt.element.max), fmt.element)
        out = elements * e8m0_value(codes)
    else:
        out, scaled = _nvfp4_quantized(blocks, matrix, fmt, draw)
    return out.reshape(blocks.shape[0], -1)[:, :k], scaled.reshape(blocks.shape[0], -1)[:, :k]


def _nvfp4_quantized(blocks: torch.Tensor, matrix: torch.Tensor, fmt: BlockFormat, draw: Optional[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(NVFP4 blocks (..., block) quantized and dequantized; scaled before the clamp), the per-tensor scale from
    the whole matrix's amax."""
    tensor_scale = nvfp4_tensor_scale(matrix) if fmt.per_tensor_scale else None
    scaled, scales = _nvfp4_scaled(blocks, tensor_scale)
    clamped = torch.clamp(scaled, -6.0, 6.0)
    if draw is None:
        elements = round_e2m1(clamped)
    else:
        elements = nvfp4_recipe.stochastic_round_e2m1(clamped, nvfp4_recipe.uniforms(clamped.shape, draw,
                                                                                     clamped.device))
    return elements * (scales if tensor_scale is None else tensor_scale * scales).unsqueeze(-1), scaled


# block_stats' figures, in its tensor's order
BLOCK_STATS = ("values", "saturated", "flushed", "blocks", "scale_saturated", "scale_underflow", "error_sq",
               "value_sq", "scale_headroom_log2")
# an E4M3 block scale beyond 448 by more than its rounding (448's step is 32: above 464 the clamp, not the rounding,
# decides it)
_E4M3_SCALE_CLIPPED = 464.0


def block_stats(matrix: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """One quantization's figures, on the device (float64, in BLOCK_STATS' order): its values, those saturated
    (beyond the element's max after the block's scale: clipped) and flushed (non-zero, quantized to zero); its
    blocks, those whose scale the scale's format clipped (E4M3 beyond 448; E8M0 at its largest, 2^127) or raised
    (E4M3 below its smallest normal 2^-6; E8M0 at its smallest, 2^-127) while the block held a non-zero value; the
    squared error and squared values (the relative RMS error is their ratio's root); and the largest block scale's
    headroom, log2(the scale format's max / it) (0: a block at the limit)."""
    original = matrix.detach().float()
    quantized, scaled = _quantize(matrix, fmt)
    blocks = nvfp4_recipe.tiles(original)[0] if fmt.tiles_2d else _blocks(original, fmt.block)[0]
    amax = blocks.abs().amax(-1)
    if fmt.scale == "e8m0":
        codes = e8m0_codes(amax, fmt.element, fmt.scale_mode)
        clipped, raised = codes >= 254, (codes == 0) & (amax > 0)
        headroom = (254 - codes.max()).float()
    else:
        raw = amax / ELEMENTS["e2m1"].max
        if fmt.per_tensor_scale:
            raw = raw / nvfp4_tensor_scale(original)
        clipped, raised = raw > _E4M3_SCALE_CLIPPED, (raw < E4M3_TINY) & (amax > 0)
        headroom = torch.log2(E4M3_MAX / raw.max().clamp(min=torch.finfo(torch.float32).tiny))
    figures = [torch.tensor(float(original.numel()), device=matrix.device), (scaled.abs() > fmt.element.max).sum(),
               ((original != 0) & (quantized == 0)).sum(), torch.tensor(float(amax.numel()), device=matrix.device),
               clipped.sum(), raised.sum(), (quantized.double() - original.double()).square().sum(),
               original.double().square().sum(), headroom]
    return torch.stack([f.double() for f in figures])


def block_outcomes(matrix: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[values, saturated, flushed] of one quantization, counted on the device (a long tensor): saturated,
    beyond the element's max after its block's scale (clipped to it); flushed, non-zero and quantized to zero."""
    return block_stats(matrix, fmt)[:3].long()
