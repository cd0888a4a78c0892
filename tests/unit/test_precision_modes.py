"""Every row of the precision table: it trains, its model has the promised layout, its flags are restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.engine.build import build_state
from ampctl.engine.precision import fp32_math
from ampctl.engine.precision.half import FP32MasterWeights
from ampctl.errors import UnsupportedError
from tests.support.simulated_cpu import AVX512_BF16, use_simulated
from tests.support.training import build


def layout(*overrides: str):
    cfg, policy, recipe = build(*overrides)
    with policy:
        return build_state(cfg, policy, recipe), policy


def test_o2_steps_fp32_masters_and_keeps_norms_fp32():
    state, _ = layout("precision=O2")
    model = state.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert linears and norms
    assert all(m.weight.dtype == torch.float16 for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in norms)
    assert isinstance(state.weights, FP32MasterWeights)
    assert all(p.dtype == torch.float32 for p in state.weights.optimizer_params)
    model_ids = {id(p) for p in model.parameters()}
    masters = [p for p in state.weights.optimizer_params if id(p) not in model_ids]
    assert len(masters) == 2 * len(linears)  # a master per half weight and bias; norms are their own
    assert state.optimizer.param_groups[0]["params"] == state.weights.optimizer_params


def test_o2_model_is_the_rounded_masters_after_steps(tmp_path):
    from ampctl.engine.loop import StepSettings, train_step
    from ampctl.engine.telemetry import Telemetry

    cfg, policy, recipe = build("precision=O2")
    with policy:
        state = build_state(cfg, policy, recipe)
        telemetry = Telemetry(policy.device, 5, recipe.samples_per_batch, None, [])
        batches = recipe.batches(policy.device, 0)
        for _ in range(3):
            train_step(state, batches, recipe, policy, StepSettings(1, 1.0), telemetry)
    half = [p for p in state.model.parameters() if p.dtype == torch.float16]
    in_model = {id(p) for p in state.model.parameters()}
    masters = [p for p in state.weights.optimizer_params if id(p) not in in_model]  # in the model's order
    assert len(masters) == len(half) > 0
    for model_param, master in zip(half, masters):
        assert master.dtype == torch.float32 and torch.equal(model_param, master.half())


def test_o3_is_pure_half_without_masters():
    state, _ = layout("precision=O3")
    assert all(p.dtype == torch.float16 for p in state.model.parameters())  # norms included
    assert not isinstance(state.weights, FP32MasterWeights)
    assert [id(p) for p in state.weights.optimizer_params] == [id(p) for p in state.model.parameters()]
    assert state.scaler.kind == "static"


def test_amp_modes_keep_fp32_weights():
    for mode in ("fp16", "bf16"):
        state, _ = layout(f"precision={mode}")
        assert all(p.dtype == torch.float32 for p in state.model.parameters())


def test_flags_are_restored_when_a_run_fails():
    before = fp32_math.snapshot()
    _, policy, _ = build("precision=fp32")
    with pytest.raises(RuntimeError), policy:
        raise RuntimeError("boom")
    assert fp32_math.snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="tf32 runs on a CUDA GPU")
def test_tf32_is_refused_on_cpu_naming_the_alternative():
    with pytest.raises(UnsupportedError, match="precision=tf32 needs TF32.*use precision=fp32"):
        build("precision=tf32", "device=cpu")


def test_bf16_is_recommended_only_where_it_is_fast(monkeypatch):
    use_simulated(monkeypatch, bf16=16.0, fp16=30.0)
    with pytest.raises(UnsupportedError) as info:
        build("precision=tf32", "device=cpu")
    assert str(info.value).endswith("this run is on a CPU: use precision=fp32")
    use_simulated(monkeypatch, bf16=0.5, fp16=30.0, flags=AVX512_BF16)
    with pytest.raises(UnsupportedError, match="use precision=fp32, or precision=bf16 for a faster mode"):
        build("precision=tf32", "device=cpu")
