"""What inspect counts against FP8 as torchao's tensorwise recipe scales it, against the definition: with
scale = fp8_max / amax (rounded to fp32, as torchao's amax_to_scale), a non-zero value flushes to zero when
|x| * scale is at most half the format's smallest subnormal (ties to even round to 0), computed in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.analysis.fp8_tensorwise import TensorwiseFp8Recorder, tensorwise_outcomes

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8 dtypes")


def flushed_by_definition(x: torch.Tensor, dtype: torch.dtype) -> int:
    a = x.double().abs()
    info = torch.finfo(dtype)
    scale = torch.tensor(info.max / max(float(a.max()), 1e-12), dtype=torch.float64).float().double()
    half_smallest_subnormal = info.tiny * info.eps / 2
    return int(((a > 0) & (a * scale <= half_smallest_subnormal)).sum())


@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "float8_e5m2"])
def test_the_flushed_count_is_the_definitions_over_a_wide_range_of_magnitudes(dtype_name):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    exponents = torch.rand(20000, generator=g) * 40 - 34  # 2^-34 .. 2^6: both sides of the flush boundary
    x = torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0) * torch.exp2(exponents)
    x[:50] = 0.0  # exact zeros lose nothing
    values, saturated, flushed = tensorwise_outcomes(x, dtype).tolist()
    assert values == 20000 and saturated == 0
    assert flushed == flushed_by_definition(x, dtype) and 0 < flushed < 20000 - 50


def test_the_recorder_counts_each_linears_input_weight_and_output_gradient():
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 1e-7, 0.5, 0.25]]))  # e4m3 flush bound at amax 1: 2^-10/448 = 2.2e-6
    model = nn.Sequential(layer)
    recorder = TensorwiseFp8Recorder(model)
    x = torch.tensor([[1.0, 1e-6, 1e-5, 0.0], [0.5, 0.5, 0.5, 0.5]])  # one of 7 non-zero inputs flushes
    with recorder:
        out = model(x)
        (out * torch.tensor([[1.0], [1e-11]])).sum().backward()  # e5m2 bound at amax 1: 2^-17/57344 = 1.3e-10
    table = recorder.table()
    row = dict(zip(table.columns, table.rows[0]))
    assert row["activation_flushed"] == pytest.approx(1 / 8) and row["weight_flushed"] == pytest.approx(1 / 4)
    assert row["gradient_flushed"] == pytest.approx(1 / 2)
    assert all(row[f"{role}_saturated"] == 0 for role in ("activation", "weight", "gradient"))
    assert not layer._forward_hooks  # the hooks exist only inside the recorder


def test_in_an_fp8_mode_only_the_converted_layers_are_recorded():
    from ampctl.engine.precision.fp8_emulated import Fp8EmulatedLinear, Fp8EmulatedOptions

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1] = Fp8EmulatedLinear.from_linear(model[1], config=Fp8EmulatedOptions())
    assert [name for name, _ in TensorwiseFp8Recorder(model).layers] == ["1"]
    assert [name for name, _ in TensorwiseFp8Recorder(nn.Sequential(nn.Linear(2, 2))).layers] == ["0"]


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_under_autocast_the_counts_are_the_definitions_on_the_tensors_the_layer_saw(half):
    """In a bf16 or fp16 mode the output gradient arrives in half precision: the counts are still the definition's,
    applied to the very tensors the layer took and gave (captured by a hook of the test's own)."""
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(64, 64)
    seen: dict[str, torch.Tensor] = {}

    def capture(module, args, output):
        seen["activation"], seen["weight"] = args[0].detach().clone(), module.weight.detach().clone()
        output.register_hook(lambda grad: seen.__setitem__("gradient", grad.detach().clone()))

    layer.register_forward_hook(capture)
    recorder = TensorwiseFp8Recorder(nn.Sequential(layer))
    x = torch.randn(32, 64, generator=g) * torch.exp2(torch.randint(-20, 4, (32, 64), generator=g).float())
    with recorder, torch.autocast("cpu", dtype=half):
        out = layer(x)
        (out.float() * torch.exp2(torch.randint(-30, 0, out.shape, generator=g).float())).sum().backward()
    assert seen["gradient"].dtype == half
    row = dict(zip(recorder.table().columns, recorder.table().rows[0]))
    for role, dtype in (("activation", torch.float8_e4m3fn), ("weight", torch.float8_e4m3fn),
                        ("gradient", torch.float8_e5m2)):
        assert row[f"{role}_flushed"] == flushed_by_definition(seen[role], dtype) / seen[role].numel(), role
    assert row["activation_flushed"] > 0  # the magnitudes span beyond E4M3's range: the test counts something
