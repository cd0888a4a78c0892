"""The profile breakdown (analysis/step_time.py): names to categories, and every microsecond of a window in exactly
one category, checked on a real CPU profile against work of known length and on a synthetic GPU one."""

from __future__ import annotations

import time
from enum import Enum
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ampctl.analysis import step_time as p
from ampctl.analysis.memory.measure import quiet_kineto
from ampctl.engine.loop import DATA_RANGE


@pytest.mark.parametrize("name,category", [
    ("aten::mm", p.MATMUL), ("aten::addmm", p.MATMUL), ("aten::bmm", p.MATMUL), ("aten::_scaled_mm", p.MATMUL),
    ("aten::convolution_backward", p.MATMUL), ("aten::mkldnn_convolution", p.MATMUL),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", p.MATMUL),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", p.MATMUL), ("triton_tem_fused_mm_0", p.MATMUL),
    ("cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", p.MATMUL),
    ("aten::_scaled_dot_product_flash_attention", p.ATTENTION), ("pytorch_flash::flash_fwd_kernel", p.ATTENTION),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", p.ATTENTION),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", p.COMMUNICATION), ("c10d::allreduce_", p.COMMUNICATION),
    ("Memcpy HtoD (Pageable -> Device)", p.COPIES), ("aten::copy_", p.COPIES),
    ("aten::gelu", p.OTHER_OPS), ("triton_poi_fused_add_gelu_0", p.OTHER_OPS),
    ("graph_0_cpp_fused_gelu_view_2", p.OTHER_OPS), ("aten::_fused_adamw_", p.OTHER_OPS),
])
def test_names_fall_in_the_category_of_what_they_compute(name, category):
    assert p.op_category(name) == category


def test_a_cpu_window_is_accounted_for_to_the_microsecond_and_data_is_the_time_the_fetch_took():
    """Each step: a 20 ms fetch, matmuls, an optimizer step; the data share is the sleep's, and the parts add up to
    the steps' wall time."""
    w = torch.randn(256, 256, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    with quiet_kineto(), profile(activities=[ProfilerActivity.CPU],
                                 schedule=schedule(wait=0, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(4):
            with record_function(DATA_RANGE):
                time.sleep(0.02)
                x = torch.randn(64, 256)
            (x @ w @ w).square().mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    result = p.breakdown(list(prof.events()), "cpu")
    assert result.steps == 3
    assert sum(result.ms_per_step.values()) == pytest.approx(result.step_ms, rel=1e-6)
    # data is the fetch's whole time (the sleep and its randn), no more: nothing from outside the range
    assert result.ms_per_step[p.DATA] >= 20.0
    assert result.ms_per_step[p.DATA] == pytest.approx(result.data_host_ms, rel=0.01)
    assert result.ms_per_step[p.MATMUL] > 0 and result.ms_per_step[p.OPTIMIZER] > 0
    # 2 forward, 3 backward (x needs no grad)
    assert next(t for t in result.top if t.name == "aten::mm").calls_per_step == 5


class _Device(Enum):
    CPU = 0
    CUDA = 1


def _event(name, start, end, device=_Device.CPU, parent=None, kernels=()):
    return SimpleNamespace(name=name, device_type=device, is_async=False, cpu_parent=parent, kernels=list(kernels),
                           time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=end - start)


def test_gpu_kernels_count_by_the_op_that_launched_them_and_the_rest_of_the_window_is_device_idle():
    """One step: a GEMM kernel whose name says nothing (launched by aten::mm), a Triton kernel, a kernel inside
    the optimizer's range; 1000 us from the first kernel's start to the last one's end."""
    kernel = lambda name, us: SimpleNamespace(name=name, device=0, duration=us)  # noqa: E731
    step = _event("ProfilerStep#7", 0, 1200)
    optimizer = _event("Optimizer.step#AdamW.step", 900, 1000, parent=step)
    events = [
        step,
        _event("aten::mm", 10, 20, parent=step, kernels=[kernel("kernel_5x", 400)]),
        _event("CompiledFunction", 30, 40, parent=step, kernels=[kernel("triton_poi_fused_mul_0", 100)]),
        optimizer,
        _event("aten::_fused_adamw_", 910, 920, parent=optimizer, kernels=[kernel("fused_adamw_kernel", 150)]),
        _event("kernel_5x", 100, 500, device=_Device.CUDA),
        _event("triton_poi_fused_mul_0", 500, 600, device=_Device.CUDA),
        _event("fused_adamw_kernel", 950, 1100, device=_Device.CUDA),
    ]
    result = p.breakdown(events, "cuda")
    assert result.step_ms == pytest.approx(1.0)
    assert result.ms_per_step == pytest.approx({p.MATMUL: 0.4, p.OPTIMIZER: 0.15, p.OTHER_OPS: 0.1,
                                                p.DEVICE_IDLE: 0.35})
    assert [t.name for t in result.top] == ["kernel_5x", "fused_adamw_kernel", "triton_poi_fused_mul_0"]
    lines = p.render(result, 7, "profile/x.pt.trace.json.gz")
    assert lines[0].startswith("profile of steps 7-7 (1 steady steps, 1.00 ms a step, device time)")
