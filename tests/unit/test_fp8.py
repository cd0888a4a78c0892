"""Emulated FP8: quantization error against the format's precision, per scaling granularity; delayed
scaling's history; gradients through the quantizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.fp8 import (E4M3, E5M2, AmaxHistory, Fp8Recipe, convert_linears, quantize_tensorwise, quantize_tiles,
                        relative_error_bound)


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


def test_delayed_scaling_uses_the_amax_history():
    history = AmaxHistory(nn.Linear(8, 8), "x", length=4, algo="max")
    big, small = torch.full((8,), 100.0), torch.full((8,), 1.0)
    first = history.scale_then_record(big, E4M3, margin=0)
    assert first == pytest.approx(448 / 100)  # no history yet: its own amax
    after = history.scale_then_record(small, E4M3, margin=0)
    assert after == pytest.approx(448 / 100)  # the big amax is still in the history
    for _ in range(3):
        history.scale_then_record(small, E4M3, margin=0)
    assert history.scale_then_record(small, E4M3, margin=0) == pytest.approx(448 / 1)  # it has rolled out
    recent = AmaxHistory(nn.Linear(8, 8), "x", length=4, algo="most_recent")
    recent.scale_then_record(big, E4M3, margin=1)
    assert recent.scale_then_record(small, E4M3, margin=1) == pytest.approx(448 / 2 / 100)


@pytest.mark.parametrize("scaling", ["current", "delayed", "blockwise"])
def test_gradients_flow_through_the_quantizers(scaling):
    torch.manual_seed(0)
    reference = nn.Linear(128, 64)
    emulated = nn.Linear(128, 64)
    emulated.load_state_dict(reference.state_dict())
    assert convert_linears(emulated, Fp8Recipe(scaling=scaling)) == 1
    x = torch.randn(32, 128)
    for model in (reference, emulated):
        model(x).square().mean().backward()
    assert emulated.weight.grad is not None and emulated.bias.grad is not None
    # FP8's precision, not a different gradient: within a few e5m2/e4m3 ulps of fp32's
    cosine = torch.nn.functional.cosine_similarity(emulated.weight.grad.flatten(), reference.weight.grad.flatten(), 0)
    assert cosine > 0.99
