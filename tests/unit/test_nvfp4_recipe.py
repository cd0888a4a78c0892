"""NVFP4's training recipe (engine/precision/nvfp4_recipe.py, and its use in mx_emulated's layers), each piece
against a definition written here or torchao's: 2D weight blocks, the random Hadamard transform, stochastic
rounding, and the layer that combines them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ampctl.engine.precision import nvfp4_recipe
from ampctl.engine.precision.block_quantize import BlockFormat, block_outcomes, fake_quantize
from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat, block_formats
from ampctl.errors import ConfigError

pytest.importorskip("torchao.prototype.moe_training.nvfp4_training.hadamard_utils")
from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import (  # noqa: E402
    get_hadamard_matrix,
    get_rht_matrix,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4 = block_formats(MXEmulatedOptions(MXFormat.nvfp4), "nvfp4")[0]
TILES = dataclasses.replace(NVFP4, tiles_2d=True)


def fake_quantize_2d(matrix: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    return fake_quantize(matrix, dataclasses.replace(fmt, tiles_2d=True))


def nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value by search, ties to the even code (the test's own definition)."""
    distance = (v.abs().unsqueeze(-1) - E2M1).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    codes = torch.arange(8)
    preference = torch.where(nearest, codes + 8 * (codes % 2), 100)  # an even code before an odd one
    return torch.copysign(E2M1[preference.min(-1).values % 8], v)


def quantize_2d_by_hand(w: torch.Tensor) -> torch.Tensor:
    """Each 16x16 tile: one E4M3 scale of (its amax / 6) / the tensor's scale (amax / (448 * 6)), its values divided
    by both, clamped to +-6, rounded to E2M1 and multiplied back."""
    tensor_scale = w.abs().max() / (448.0 * 6.0)
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], 16):
        for j in range(0, w.shape[1], 16):
            tile = w[i:i + 16, j:j + 16]
            scale = torch.clamp(tile.abs().max() / 6.0 / tensor_scale, 2.0**-6, 448.0).to(torch.float8_e4m3fn).float()
            scaled = torch.clamp(tile * ((1.0 / tensor_scale) / scale), -6.0, 6.0)
            out[i:i + 16, j:j + 16] = nearest_e2m1(scaled) * (tensor_scale * scale)
    return out


@pytest.mark.parametrize("shape", [(64, 48), (40, 56)])  # the second padded both ways
def test_a_2d_quantized_weight_and_its_transpose_are_the_same_matrix(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-2, 1, shape[1])  # columns of very different magnitude
    assert torch.equal(fake_quantize_2d(w, NVFP4).t(), fake_quantize_2d(w.t(), NVFP4))
    assert torch.equal(fake_quantize_2d(w, NVFP4), quantize_2d_by_hand(w))
    # 1D blocks along each GEMM's reduction dimension give W and W^T different values: what 2D blocks are for
    assert not torch.equal(fake_quantize(w, NVFP4).t(), fake_quantize(w.t(), NVFP4))
    # what inspect counts of a 2D weight is what its tiles flush to zero
    values, _, flushed = block_outcomes(w, TILES).tolist()
    assert values == w.numel() and flushed == int(((w != 0) & (quantize_2d_by_hand(w) == 0)).sum())


def test_the_hadamard_and_rht_matrices_are_torchaos():
    assert torch.equal(nvfp4_recipe.hadamard16(), get_hadamard_matrix(16, "cpu", torch.float32))
    signs = nvfp4_recipe.sign_vector(1234)
    assert set(signs.tolist()) == {-1.0, 1.0}
    ours = nvfp4_recipe.rht_matrix(signs)
    assert torch.equal(ours, get_rht_matrix(tuple(int(s) for s in signs), "cpu", torch.float32, 16))
    assert torch.allclose(ours @ ours.t(), torch.eye(16), atol=0, rtol=0)  # exactly orthogonal: entries +-1/4


def test_the_rht_leaves_an_unquantized_weight_gradient_unchanged():
    torch.manual_seed(1)
    tokens, n, k = 37, 24, 20  # tokens not a multiple of 16: both operands padded alike
    g, x = torch.randn(tokens, n), torch.randn(tokens, k) * 10
    rht = nvfp4_recipe.rht_matrix(nvfp4_recipe.sign_vector(7))
    transformed = nvfp4_recipe.rht_along_columns(g.t(), rht) @ nvfp4_recipe.rht_along_columns(x.t(), rht).t()
    exact = (g.double().t() @ x.double()).float()
    assert torch.allclose(transformed, exact, rtol=1e-5, atol=1e-4)


def test_the_rht_spreads_an_outlier_over_its_block():
    x = torch.zeros(1, 16)
    x[0, 3] = 100.0  # one token far out (an attention sink)
    spread = nvfp4_recipe.rht_along_columns(x, nvfp4_recipe.rht_matrix(nvfp4_recipe.sign_vector(0)))
    assert torch.allclose(spread.abs(), torch.full((1, 16), 25.0))


@pytest.mark.parametrize("value", [0.3, 1.2, 1.9, 2.5, 3.7, 5.1, -4.4, -0.1])
def test_stochastic_rounding_is_unbiased_and_draws_only_the_two_neighbours(value):
    draws = 10_000
    x = torch.full((draws,), value)
    rounded = torch.stack([nvfp4_recipe.stochastic_round_e2m1(x, nvfp4_recipe.uniforms(x.shape, key, x.device))
                           for key in (11, 12)]).flatten()
    below = E2M1[E2M1 <= abs(value)].max()
    above = E2M1[E2M1 >= abs(value)].min()
    assert set(rounded.abs().unique().tolist()) == {below.item(), above.item()}
    standard_error = rounded.std() / len(rounded) ** 0.5
    assert abs(rounded.mean().item() - value) < 3 * standard_error.item()


def test_stochastic_rounding_keeps_a_value_on_the_grid_and_reruns_alike():
    grid = torch.cat([E2M1, -E2M1])
    u = nvfp4_recipe.uniforms(grid.shape, 99, grid.device)
    assert torch.equal(nvfp4_recipe.stochastic_round_e2m1(grid, u), grid)
    x = torch.randn(4096).clamp(-6, 6)
    first = nvfp4_recipe.stochastic_round_e2m1(x, nvfp4_recipe.uniforms(x.shape, 5, x.device))
    assert torch.equal(first, nvfp4_recipe.stochastic_round_e2m1(x, nvfp4_recipe.uniforms(x.shape, 5, x.device)))
    assert not torch.equal(first, nvfp4_recipe.stochastic_round_e2m1(x, nvfp4_recipe.uniforms(x.shape, 6, x.device)))


def test_the_uniforms_are_uniform():
    u = nvfp4_recipe.uniforms(torch.Size([100_000]), 3, torch.device("cpu"))
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (counts - 10_000).abs().max().item() < 5 * 100  # 5 standard deviations of a binomial bin


def recipe_layer(seed: int, **recipe: bool) -> tuple[MXEmulatedConverter, nn.Module, nn.Linear]:
    torch.manual_seed(seed)
    converter = MXEmulatedConverter(MXEmulatedOptions(MXFormat.nvfp4, **recipe), torch.device("cpu"))
    linear = nn.Linear(40, 24)
    return converter, converter.convert(linear, "blocks.0.mlp", "nvfp4"), linear


def gradients(converter: MXEmulatedConverter, layer: nn.Module, linear: nn.Linear, step: int,
              calls: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(100)
    x = torch.randn(3, 37, 40)
    converter.at_step(step)
    linear.weight.grad = None
    for _ in range(calls):  # micro-batches: each call draws its own bits
        layer(x).square().sum().backward()
    return [linear.weight.grad.clone()]


def test_a_recipe_layer_draws_by_seed_step_and_call_and_nothing_else():
    everything = {"weights_2d": True, "rht": True, "stochastic_rounding": True}
    converter, layer, linear = recipe_layer(0, **everything)
    first = gradients(converter, layer, linear, step=5)
    again_converter, again_layer, again_linear = recipe_layer(0, **everything)  # a rerun, or a resume at step 5
    gradients(again_converter, again_layer, again_linear, step=3)  # whatever ran before step 5
    assert torch.equal(first[0], gradients(again_converter, again_layer, again_linear, step=5)[0])
    assert not torch.equal(first[0], gradients(converter, layer, linear, step=6)[0])
    other_seed = recipe_layer(1, **everything)
    other_seed[2].load_state_dict(linear.state_dict())
    assert not torch.equal(first[0], gradients(*other_seed, step=5)[0])


def test_without_stochastic_rounding_a_recipe_layers_gradient_is_its_steps_alone():
    converter, layer, linear = recipe_layer(0, weights_2d=True, rht=True)
    assert torch.equal(gradients(converter, layer, linear, step=1)[0], gradients(converter, layer, linear, step=2)[0])


def test_the_weight_gradient_with_rht_and_without_quantization_error_is_the_plain_one():
    """The RHT changes only which values are quantized: its weight gradient stays near the unquantized one (as
    close as plain nvfp4's is), never off by the transform itself."""
    converter, layer, linear = recipe_layer(0, rht=True)
    with_rht = gradients(converter, layer, linear, step=1)[0]
    reference = nn.Linear(40, 24)
    reference.load_state_dict(linear.state_dict())
    torch.manual_seed(100)
    reference(torch.randn(3, 37, 40)).square().sum().backward()
    plain_converter, plain_layer, plain_linear = recipe_layer(0)
    plain = gradients(plain_converter, plain_layer, plain_linear, step=1)[0]
    error = ((with_rht - reference.weight.grad).norm() / reference.weight.grad.norm()).item()
    plain_error = ((plain - reference.weight.grad).norm() / reference.weight.grad.norm()).item()
    assert error < 2 * plain_error and error < 0.5


@pytest.mark.parametrize("key", ["weights_2d", "rht", "stochastic_rounding"])
@pytest.mark.parametrize("fmt", [MXFormat.mxfp8, MXFormat.mxfp4])
def test_a_recipe_option_on_a_format_without_it_is_refused(key, fmt):
    with pytest.raises(ConfigError, match=f"precision.options.{key}"):
        MXEmulatedOptions(fmt, **{key: True})
