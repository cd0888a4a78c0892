"""The FP8 tests train with oneDNN off (tests/support/fp8_anywhere.torchs_own_fp8_matmul), where torch._scaled_mm
takes torch's own CPU kernel instead of oneDNN's reference FP8 matmul: it holds only while the two agree bit for
bit, which this checks for both of torchao's scalings and both output dtypes."""

from __future__ import annotations

import pytest
import torch

# torch warns about Intel GPUs whenever the oneDNN flags are set on a CPU-only build
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_torchs_cpu_fp8_matmul_is_onednns_bit_for_bit(scaling, out_dtype):
    generator = torch.Generator().manual_seed(0)
    m, k, n = 16, 32, 48
    a = (torch.randn(m, k, generator=generator) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=generator) * 4).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes
    if scaling == "tensorwise":
        scale_a, scale_b = torch.tensor(0.5), torch.tensor(0.25)
    else:
        scale_a, scale_b = torch.rand(m, 1, generator=generator) + 0.1, torch.rand(1, n, generator=generator) + 0.1
    products = []
    for onednn in (True, False):
        with torch.backends.mkldnn.flags(enabled=onednn):
            products.append(torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype))
    assert torch.equal(*products)
    by_definition = ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)  # an independent reference
    torch.testing.assert_close(products[0], by_definition, rtol=1e-2 if out_dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5)
