"""precision.options.kernels=torchao: torchao's MXFP8 training layer (its emulated reference on this machine, the
code path a B200 runs with its kernels) against ampctl's emulation: equal bit for bit in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ampctl.engine.precision import mx_torchao
from ampctl.engine.precision.block_quantize import MXScaleMode
from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat, MXKernels, MXLinear
from ampctl.errors import ConfigError

pytestmark = pytest.mark.skipif(mx_torchao.missing() is not None, reason="needs torchao's MXFP8 training layer")


def pair(mode: str, dtype: torch.dtype, bias: bool = True) -> tuple[nn.Module, nn.Module, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(dtype)
    if bias:
        with torch.no_grad():
            linear.bias.normal_()
    theirs_linear, ours_linear = copy.deepcopy(linear), copy.deepcopy(linear)
    theirs = mx_torchao.convert(theirs_linear, real_kernels=False, scale_mode=mode)
    ours = MXLinear.from_linear(ours_linear, config=MXEmulatedOptions(MXFormat.mxfp8, scale_mode=MXScaleMode[mode]),
                                fmt="mxfp8")
    return theirs, ours, theirs_linear, ours_linear


def run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out, x.grad


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("tokens", [(4, 32), (3, 37)])  # 37 x 3 tokens: padded to whole blocks along the tokens
def test_torchaos_layer_equals_ampctls_emulation_bit_for_bit_in_fp32(mode, tokens):
    theirs, ours, theirs_linear, ours_linear = pair(mode, torch.float32)
    x = torch.randn(*tokens, 64) * torch.logspace(-3, 3, 64)
    grad = torch.randn(*tokens, 96)
    (out_t, dx_t), (out_o, dx_o) = run(theirs, x, grad), run(ours, x, grad)
    assert torch.equal(out_t, out_o) and torch.equal(dx_t, dx_o)
    assert torch.equal(theirs_linear.weight.grad, ours_linear.weight.grad)
    assert torch.equal(theirs_linear.bias.grad, ours_linear.bias.grad)  # torchao's quantize_ path drops it (ao#4846)


def test_in_bf16_they_differ_only_by_where_the_bias_is_rounded():
    """torchao adds the bias to the bf16 output (two roundings); ampctl to the fp32 product, then rounds once."""
    x, grad = torch.randn(2, 32, 64, dtype=torch.bfloat16), torch.randn(2, 32, 96, dtype=torch.bfloat16)
    theirs, ours, *_ = pair("rceil", torch.bfloat16, bias=False)
    (product, _), (ours_product, _) = run(theirs, x, grad), run(ours, x, grad)
    assert torch.equal(product, ours_product) and torch.equal(*(run(layer, x, grad)[1] for layer in (theirs, ours)))
    theirs, ours, *_ = pair("rceil", torch.bfloat16, bias=True)
    (out_t, _), (out_o, _) = run(theirs, x, grad), run(ours, x, grad)
    # torchao's product rounded (half a bf16 step of it), then their sums rounded (one step of the sum apart at most)
    bound = product.float().abs() * 2.0**-8 + torch.maximum(out_t.float().abs(), out_o.float().abs()) * 2.0**-7
    assert ((out_t.float() - out_o.float()).abs() <= bound).all() and not torch.equal(out_t, out_o)


def test_the_converter_gives_torchao_the_layers_in_whole_blocks_and_says_so():
    converter = MXEmulatedConverter(MXEmulatedOptions(MXFormat.mxfp8, kernels=MXKernels.torchao), torch.device("cpu"))
    assert converter.torchao and not converter.real_kernels and converter.emulated  # no MXFP8 tensor cores here
    assert type(converter.convert(nn.Linear(64, 96), "a", "mxfp8")).__name__ == "TorchaoMXFP8Linear"
    assert isinstance(converter.convert(nn.Linear(64, 10), "head", "mxfp8"), MXLinear)  # 10: not whole blocks
    assert "mxfp8=torchao's emulated reference" in converter.describe()
    auto = MXEmulatedConverter(MXEmulatedOptions(MXFormat.mxfp8, kernels=MXKernels.auto), torch.device("cpu"))
    assert not auto.torchao and isinstance(auto.convert(nn.Linear(64, 96), "a", "mxfp8"), MXLinear)


@pytest.mark.parametrize("options", [{"format": MXFormat.nvfp4}, {"format": MXFormat.mxfp4},
                                     {"format": MXFormat.mxfp8, "scale_mode": MXScaleMode.even}])
def test_kernels_torchao_where_torchaos_layer_does_not_compute_it_is_refused(options):
    with pytest.raises(ConfigError, match="precision.options.kernels"):
        MXEmulatedOptions(kernels=MXKernels.torchao, **options)

