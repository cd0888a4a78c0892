"""Emulated FP8: quantization error against the format's precision, per scaling granularity; delayed
scaling's history; gradients through the quantizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.engine.precision.fp8_emulated import (
    E4M3,
    E5M2,
    DelayedScaling,
    Fp8EmulatedLinear,
    Fp8EmulatedOptions,
    Fp8Format,
    Fp8Scaling,
    quantize_tensorwise,
    quantize_tiles,
    relative_error_bound,
    scale_from_amax,
)


def normal_values(shape, seed=0):
    """Magnitudes spread over 2^-4 .. 2^4: normal in e4m3 whatever the scale picks."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return sign * 2.0 ** (torch.rand(shape, generator=gen) * 8 - 4)


@pytest.mark.parametrize("granularity", ["tensorwise", "1x128", "128x128"])
def test_e4m3_relative_error_is_within_half_an_ulp(granularity):
    x = normal_values((256, 384))
    q = {"tensorwise": lambda: quantize_tensorwise(x, E4M3),
         "1x128": lambda: quantize_tiles(x, E4M3, 1, 128),
         "128x128": lambda: quantize_tiles(x, E4M3, 128, 128)}[granularity]()
    error = ((q - x).abs() / x.abs()).max()
    assert relative_error_bound(E4M3) == 2.0**-4
    assert 0 < error <= 2.0**-4


def test_e5m2_has_half_the_precision_of_e4m3():
    x = normal_values((64, 64))
    error = ((quantize_tensorwise(x, E5M2) - x).abs() / x.abs()).max()
    assert 2.0**-4 < error <= relative_error_bound(E5M2) == 2.0**-3


def test_fine_grained_scaling_keeps_a_small_tile_that_one_scale_would_flush():
    x = torch.ones(4, 256)
    x[:, 128:] = 1e-6  # a tile of tiny values next to a tile of ones
    assert quantize_tensorwise(x, E4M3)[0, 200] == 0  # under one tensor-wide scale: below e4m3's range
    assert quantize_tiles(x, E4M3, 1, 128)[0, 200] == pytest.approx(1e-6, rel=2.0**-4)


def hard_values(seed=0, n=4096):
    """Outliers, exact zeros, tiny values (down to fp32 subnormals) and ordinary ones, both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-30, 10, (n,), generator=gen).float()
    x[::97] = 0.0
    x[5], x[6], x[7] = 3e4, -1e-30, 1e-44
    return x


def test_the_scale_is_torchaos_amax_to_scale_bit_for_bit():
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    gen = torch.Generator().manual_seed(0)
    amaxes = torch.cat([torch.rand(20000, generator=gen) * 2.0 ** torch.randint(-60, 60, (20000,), generator=gen),
                        torch.tensor([0.0, 1e-45, 1e-38, 1e-13, 1e-12, 1.0, 448.0, 3e38])])
    for dtype in (E4M3, E5M2):
        ours, theirs = scale_from_amax(amaxes, dtype), float8_utils.amax_to_scale(amaxes, dtype)
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs)
        assert torch.isfinite(ours).all()
        # the old formula, reciprocal(amax) * max in fp32, is an ulp off for a good share of amaxes
        naive = torch.reciprocal(amaxes.clamp(min=torch.finfo(torch.float32).tiny)) * torch.finfo(dtype).max
        assert (naive != theirs).float().mean() > 0.05


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_tensorwise_quantization_is_torchaos_bit_for_bit(dtype):
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    training_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
    for seed in range(3):
        x = hard_values(seed)
        scale = float8_utils.tensor_to_scale(x, dtype)
        reference = training_tensor.hp_tensor_and_scale_to_float8(x, scale, dtype).to_original_precision()
        assert torch.equal(quantize_tensorwise(x, dtype), reference)


@pytest.mark.parametrize("tiny", [0.0, 1e-40, 2e-38])
def test_tiny_or_zero_tensors_and_tiles_quantize_to_finite_values(tiny):
    """An infinite scale would turn the zeros beside a tiny value into NaN (0 * inf)."""
    values = torch.zeros(4, 256)
    values[:, 128] = tiny  # one tiny value among zeros, in the second 1x128 tile of every row
    x = torch.randn(4, 256)
    x[:, 128:] = values[:, 128:]
    for quantized in (quantize_tensorwise(values, E4M3), quantize_tiles(x, E4M3, 1, 128),
                      quantize_tiles(x, E4M3, 128, 128), quantize_tiles(values, E5M2, 1, 128)):
        assert torch.isfinite(quantized).all()
    assert torch.equal(quantize_tiles(x, E4M3, 1, 128)[:, 128:], torch.zeros(4, 128))  # below e4m3's reach


class TransformerEngineDelayedScaling:
    """An independent reference: TE's DelayedScaling for one tensor, as transformer_engine/pytorch's
    quantization.py writes it (history slot 0 is this step's amax; after the update the history rolls by -1
    and slot 0 is cleared; _default_sf_compute turns the amax into the next scale)."""

    def __init__(self, length, algo, fp8_max, margin):
        self.history = torch.zeros(length)
        self.scale = torch.ones(())
        self.algo, self.fp8_max, self.margin = algo, fp8_max, margin

    def step(self, x):
        used = self.scale.clone()
        self.history[0] = x.abs().max()
        amax = self.history.max() if self.algo == "max" else self.history[0].clone()
        self.history = torch.roll(self.history, -1, 0)
        self.history[0] = 0.0
        sf = (self.fp8_max / amax) / (2**self.margin)
        sf = torch.where(amax > 0.0, sf, self.scale)
        sf = torch.where(torch.isfinite(amax), sf, self.scale)
        self.scale = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
        return used


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 0), ("max", 2), ("most_recent", 1)])
def test_delayed_scaling_follows_transformer_engine_step_by_step(algo, margin):
    layer = nn.Linear(8, 8)
    ours = DelayedScaling(layer, "x", length=4, algo=algo)
    reference = TransformerEngineDelayedScaling(4, algo, 448.0, margin)
    magnitudes = [100.0, 1.0, 0.0, 3.0, 1e-40, 0.5, 0.0, 0.0, 0.0, 0.0, 7.0, 2.0]
    for step, magnitude in enumerate(magnitudes):
        x = torch.full((8,), magnitude)
        x[0] = -magnitude
        used = reference.step(x)
        if step == 0:
            assert used == 1.0  # TE's first step: no history yet, scale 1
        assert torch.equal(ours.quantize(x, E4M3, margin), x.float().mul(used).clamp(-448, 448).to(E4M3).float() / used)
        assert torch.equal(getattr(layer, "fp8_scale_x"), reference.scale), (step, magnitude)
    # an all-zero amax keeps the previous scale (it does not fall back to 1)
    assert float(getattr(layer, "fp8_scale_x")) != 1.0


def reference_tiles_128x1(x):
    """DeepSeek-V3's 128x1 tiles written out: for every column, one scale per 128 consecutive rows (tokens),
    from torchao's amax_to_scale formula."""
    out = torch.empty_like(x)
    for col in range(x.shape[1]):
        for start in range(0, x.shape[0], 128):
            tile = x[start:start + 128, col]
            scale = (448.0 / tile.abs().max().double().clamp(min=1e-12)).float()
            out[start:start + 128, col] = (tile * scale).clamp(-448, 448).to(E4M3).float() / scale
    return out


def test_blockwise_weight_gradient_quantizes_along_tokens():
    """Forward tiles run along the reduction dimension K; the weight gradient reduces over tokens, so its
    operands are quantized again in 128x1 tiles (Transformer Engine's columnwise usage)."""
    torch.manual_seed(0)
    layer = Fp8EmulatedLinear.from_linear(nn.Linear(64, 32), config=Fp8EmulatedOptions(
        scaling=Fp8Scaling.blockwise, format=Fp8Format.e4m3))
    x = torch.randn(256, 64) * torch.logspace(-3, 3, 256)[:, None]  # token magnitudes vary: tiles matter
    x.requires_grad_(True)
    g = torch.randn(256, 32) * torch.logspace(2, -2, 256)[:, None]
    layer(x).backward(g)
    expected_w = reference_tiles_128x1(g).t() @ reference_tiles_128x1(x.detach())
    assert torch.equal(layer.weight.grad, expected_w)
    expected_x = quantize_tiles(g, E4M3, 1, 128) @ quantize_tiles(layer.weight.detach(), E4M3, 128, 128)
    assert torch.equal(x.grad, expected_x)
    assert torch.allclose(layer.bias.grad, g.sum(0))  # a sum of the unquantized gradient, as torchao and TE


@pytest.mark.parametrize("scaling", ["current", "delayed", "blockwise"])
def test_gradients_flow_through_the_quantizers(scaling):
    torch.manual_seed(0)
    reference = nn.Linear(128, 64)
    fmt = Fp8Format.e4m3 if scaling == "blockwise" else Fp8Format.hybrid  # blockwise is e4m3 only
    emulated = Fp8EmulatedLinear(128, 64, config=Fp8EmulatedOptions(scaling=Fp8Scaling(scaling), format=fmt))
    emulated.load_state_dict(reference.state_dict(), strict=False)  # delayed scaling's buffers start afresh
    x = torch.randn(32, 128)
    for model in (reference, emulated):
        model(x).square().mean().backward()
    assert emulated.weight.grad is not None and emulated.bias.grad is not None
    # FP8's precision, not a different gradient: within a few e5m2/e4m3 ulps of fp32's
    cosine = torch.nn.functional.cosine_similarity(emulated.weight.grad.flatten(), reference.weight.grad.flatten(), 0)
    assert cosine > 0.99
