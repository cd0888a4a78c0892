"""The emulated microscaling formats against torchao's reference (torchao.prototype.mx_formats), bit for bit:
MX's E8M0 scale codes and elements under each scale-calculation mode, NVFP4's E4M3 block scales and elements
with and without the per-tensor scale, and the dequantized values; over random tensors spanning many binades
and blocks of zeros, tiny and huge values, inf and NaN. Then the layer's three matmuls and their blocking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.engine.precision.block_quantize import (
    ELEMENTS,
    BlockFormat,
    MXScaleMode,
    e8m0_value,
    fake_quantize,
    nvfp4_tensor_scale,
    quantize_mx_blocks,
    quantize_nvfp4_blocks,
    round_e2m1,
)
from ampctl.engine.precision.mx_emulated import MXElements, MXEmulatedOptions, MXFormat, MXLinear, block_formats

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is the extra ampctl[fp8]")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    nvfp4_quantize,
    per_tensor_amax_to_scale,
)

TORCHAO_ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
TINY, HUGE = 2.0**-135, 3.0e38


def edge_tensor(block: int, seed: int = 0) -> torch.Tensor:
    """Rows of blocks: random magnitudes over 2^-30..2^30, and blocks that are all zeros, tiny (subnormal fp32),
    huge (near fp32's max), mixed tiny and huge, with an inf, a -inf, a NaN, exact ties of E2M1 and powers of two."""
    gen = torch.Generator().manual_seed(seed)
    random = torch.randn(24, block * 4, generator=gen) * 2.0 ** torch.randint(-30, 30, (24, 4), generator=gen
                                                                              ).repeat_interleave(block, 1)
    special = torch.zeros(8, block * 4)
    special[0, block:2 * block] = TINY * torch.arange(block)
    special[1, :block] = HUGE
    special[1, block:2 * block] = -HUGE * torch.linspace(0, 1, block)
    special[2, :block] = torch.linspace(-TINY, HUGE, block)
    special[3, 3] = float("inf")
    special[3, block + 5] = float("-inf")
    special[4, 2 * block + 1] = float("nan")
    special[5, :block] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5] * (block // 8))  # E2M1 ties
    special[5, block:2 * block] = 6.0  # the block max lands exactly on E2M1's max
    special[6, :] = 2.0 ** torch.arange(-64, -64 + block * 4).float().clamp(max=120)
    special[7, :] = torch.randn(block * 4, generator=gen) * 1e-3
    return torch.cat([random, special])


def same_bits(mine: torch.Tensor, reference: torch.Tensor) -> bool:
    """Bit for bit, with every NaN equal to every NaN (torch's casts do not keep NaN payloads)."""
    nan = torch.isnan(mine)
    return torch.equal(nan, torch.isnan(reference)) and torch.equal(mine[~nan].view(torch.int32),
                                                                     reference[~nan].view(torch.int32))


def torchao_elements(data: torch.Tensor, element: str) -> torch.Tensor:
    return f4_unpacked_to_f32(unpack_uint4(data)) if element == "e2m1" else data.float()


@pytest.mark.parametrize("mode", list(MXScaleMode))
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_mx_scales_and_elements_equal_torchaos_to_mx(element, mode):
    x = edge_tensor(32)
    scale, data = mx.to_mx(x, TORCHAO_ELEMENTS[element], 32, ScaleCalculationMode(mode.value))
    elements, codes = quantize_mx_blocks(x.reshape(x.shape[0], -1, 32), ELEMENTS[element], mode)
    assert torch.equal(codes.squeeze(-1), scale.view(torch.uint8).to(torch.int32))
    reference = torchao_elements(data, element).reshape(elements.shape)
    # E2M1 has no NaN: torchao leaves an arbitrary code in a NaN block, whose NaN scale decodes it to NaN anyway
    defined = (codes != 255).expand_as(elements) if element == "e2m1" else torch.ones_like(elements, dtype=torch.bool)
    assert same_bits(elements[defined], reference[defined])
    decoded = elements * e8m0_value(codes)
    torchao_decoded = mx.to_dtype(data, scale, TORCHAO_ELEMENTS[element], 32, torch.float32)
    assert same_bits(decoded.reshape(x.shape), torchao_decoded)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_nvfp4_scales_and_elements_equal_torchaos(per_tensor):
    x = edge_tensor(16)
    x = x[torch.isfinite(x).all(1)] if per_tensor else x  # one inf or NaN makes the per-tensor scale inf or NaN
    tensor_scale = per_tensor_amax_to_scale(x.abs().max()) if per_tensor else None
    scales, data = nvfp4_quantize(x, 16, tensor_scale)
    mine_scale = nvfp4_tensor_scale(x) if per_tensor else None
    if per_tensor:
        assert same_bits(mine_scale, tensor_scale.float())
    elements, mine_scales = quantize_nvfp4_blocks(x.reshape(x.shape[0], -1, 16), mine_scale)
    assert same_bits(mine_scales, scales.float().reshape(mine_scales.shape))
    defined = ~torch.isnan(mine_scales).unsqueeze(-1).expand_as(elements)
    assert same_bits(elements[defined], torchao_elements(data, "e2m1").reshape(elements.shape)[defined])
    fmt = BlockFormat(ELEMENTS["e2m1"], 16, "e4m3", per_tensor_scale=per_tensor)
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale).dequantize(torch.float32)
    assert same_bits(fake_quantize(x, fmt), reference)


def test_an_all_zero_tensor_is_zeros_under_nvfp4s_per_tensor_scale():
    """The one deliberate difference from torchao, whose per-tensor scale 0 / 0 turns zeros into NaN."""
    zeros = torch.zeros(2, 32)
    fmt = BlockFormat(ELEMENTS["e2m1"], 16, "e4m3", per_tensor_scale=True)
    assert torch.equal(fake_quantize(zeros, fmt), zeros)
    torchao = NVFP4Tensor.to_nvfp4(zeros, per_tensor_scale=per_tensor_amax_to_scale(zeros.abs().max()))
    assert torch.isnan(torchao.dequantize(torch.float32)).all()


def test_e2m1_rounds_to_nearest_even_over_its_whole_grid():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.linspace(-6, 6, 4801)
    nearest = grid[(x.abs()[:, None] - grid).abs().argmin(1)] * x.sign()
    ties = (x.abs()[:, None] - grid).abs().sort(1).values
    not_tie = ties[:, 0] != ties[:, 1]
    assert torch.equal(round_e2m1(x)[not_tie], nearest[not_tie])
    # the ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert round_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_a_dimension_not_a_multiple_of_the_block_is_padded_with_zeros():
    x = torch.randn(4, 40)
    fmt = BlockFormat(ELEMENTS["e4m3"], 32, "e8m0")
    padded = torch.nn.functional.pad(x, (0, 24))
    assert torch.equal(fake_quantize(x, fmt), fake_quantize(padded, fmt)[:, :40])


def reference_mm(a: torch.Tensor, b_t: torch.Tensor, fa: BlockFormat, fb: BlockFormat) -> torch.Tensor:
    """a @ b_t.T with both operands quantized along the reduction dimension, through torchao's to_mx/to_dtype."""
    def q(t, f):
        scale, data = mx.to_mx(t.contiguous(), TORCHAO_ELEMENTS[f.element.name], 32, ScaleCalculationMode.FLOOR)
        return mx.to_dtype(data, scale, TORCHAO_ELEMENTS[f.element.name], 32, torch.float32)
    return q(a, fa) @ q(b_t, fb).t()


def test_the_three_matmuls_block_along_their_reduction_dimension():
    """torchao's mx_mm layout: forward along K; grad input along N; grad weight along the tokens."""
    torch.manual_seed(0)
    config = MXEmulatedOptions(format=MXFormat.mxfp8, grad_elements=MXElements.e5m2)
    layer = MXLinear.from_linear(nn.Linear(64, 96), config=config, fmt="mxfp8")
    x = (torch.randn(128, 64) * torch.logspace(-3, 3, 128)[:, None]).requires_grad_(True)
    g = torch.randn(128, 96) * torch.logspace(2, -2, 128)[:, None]
    out = layer(x)
    fwd, grad = layer.forward_format, layer.grad_format
    assert grad.element.name == "e5m2" and fwd.element.name == "e4m3"
    assert torch.equal(out, reference_mm(x.detach(), layer.weight.detach(), fwd, fwd) + layer.bias.detach())
    out.backward(g)
    assert torch.equal(x.grad, reference_mm(g, layer.weight.detach().t(), grad, fwd))
    assert torch.equal(layer.weight.grad, reference_mm(g.t(), x.detach().t(), grad, fwd))
    assert torch.equal(layer.bias.grad, g.sum(0))  # a sum of the unquantized gradient


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_the_quantization_error_is_within_the_formats_precision(fmt):
    """Blocks of one binade each, under scales that cannot clip (rceil for MX): relative error at most half an ulp
    of the element (2^-4 for E4M3, 2^-2 for E2M1), plus the E4M3 block scale's own rounding for NVFP4."""
    torch.manual_seed(0)
    x = (1 + torch.rand(64, 64)) * 2.0 ** torch.randint(-8, 8, (64, 1)).float()
    forward, _ = block_formats(MXEmulatedOptions(format=MXFormat(fmt), scale_mode=MXScaleMode.floor
                                                if fmt == "nvfp4" else MXScaleMode.rceil), fmt)
    error = ((fake_quantize(x, forward) - x).abs() / x.abs()).max().item()
    bound = {"mxfp8": 2.0**-4, "mxfp4": 2.0**-2, "nvfp4": 2.0**-2 * (1 + 2.0**-4) + 2.0**-4}[fmt]
    assert 0 < error <= bound, (fmt, error)


def test_the_specs_floor_scale_clips_a_block_whose_amax_mantissa_exceeds_the_elements_max():
    """OCP MX v1.0's scale 2^(floor(log2 amax) - emax) maps 1.9 * 2^k to 1.9 * 256 = 486 > 448 = E4M3's max: the
    block's largest value saturates (the known cost of floor, which rceil avoids)."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 1.9
    floor, rceil = (block_formats(MXEmulatedOptions(scale_mode=mode), "mxfp8")[0]
                    for mode in (MXScaleMode.floor, MXScaleMode.rceil))
    assert fake_quantize(x, floor)[0, 0].item() == 448 / 256
    assert fake_quantize(x, rceil)[0, 0].item() == pytest.approx(1.9, rel=2.0**-4)


@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
def test_block_outcomes_count_what_torchaos_quantization_clips_and_flushes(element):
    """saturated: |x| beyond the element's max times the block's scale; flushed: non-zero, dequantized to zero;
    both read off torchao's own to_mx and to_dtype."""
    from ampctl.engine.precision.block_quantize import block_outcomes

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 128, generator=gen) * torch.logspace(-6, 0, 128)  # wide blocks: tiny values flush
    fmt = BlockFormat(ELEMENTS[element], 32, "e8m0")
    scale, data = mx.to_mx(x, TORCHAO_ELEMENTS[element], 32, ScaleCalculationMode.FLOOR)
    decoded = mx.to_dtype(data, scale, TORCHAO_ELEMENTS[element], 32, torch.float32)
    block_max = (mx.get_fp_scale(scale) * ELEMENTS[element].max).repeat_interleave(32, -1)
    values, saturated, flushed = block_outcomes(x, fmt).tolist()
    assert values == x.numel()
    assert saturated == int((x.abs() > block_max).sum()) > 0
    assert flushed == int(((x != 0) & (decoded == 0)).sum()) > 0


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_rceil_never_clips_where_floor_does(element):
    from ampctl.engine.precision.block_quantize import block_outcomes

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 3
    floor, rceil = (BlockFormat(ELEMENTS[element], 32, "e8m0", mode) for mode in (MXScaleMode.floor, MXScaleMode.rceil))
    assert block_outcomes(x, floor)[1] > 0 and block_outcomes(x, rceil)[1] == 0
