"""What precision the matmuls ran in (analysis/matmul_dtypes.py, train.profile's line and summary.json's
profile.matmul_dtypes): each mode's matmul FLOPs by operand dtype, read from the profiler's events, equal a count
taken another way: a TorchDispatchMode that sees every aten GEMM of one training step on ampctl's own state (its
operands' shapes and dtypes) and adds up 2·M·N·K by dtype."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampctl
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, batch_stream, train_step
from ampctl.engine.telemetry import Telemetry
from tests.support.training import FAST, QUIET, build

aten = torch.ops.aten
FIRST_MATRIX = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0, aten.baddbmm.default: 1,
                aten._scaled_mm.default: 0}


class CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FIRST_MATRIX:
            a, b = args[FIRST_MATRIX[func]], args[FIRST_MATRIX[func] + 1]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops[str(a.dtype).removeprefix("torch.")] += 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def counted(overrides: list[str], base: list[str] = FAST) -> dict[str, float]:
    """One step's GEMM FLOPs by dtype, its batches drawn before the count (a recipe's own arithmetic is not the
    model's)."""
    cfg, policy, recipe = build(*overrides, base=base)
    with policy:
        state = build_state(cfg, policy, recipe)
        batches = [next(batch_stream(recipe, policy.device, cfg.train.seed)) for _ in range(cfg.train.grad_accum_steps)]
        telemetry = Telemetry(policy.device, 1, recipe.samples_per_batch, None, [])
        with CountGemms() as count:
            train_step(state, iter(batches), recipe, policy, StepSettings.of(cfg.train), telemetry)
    return dict(count.flops)


@pytest.mark.parametrize("overrides", [["precision=fp32"], ["precision=bf16"], ["precision=fp16"], ["precision=O2"],
                                       ["precision=bf16", "precision.rules=[{match:'9',run_in:fp32}]"],
                                       ["precision=bf16_true"]], ids=lambda o: " ".join(o))
def test_the_profiled_matmul_dtypes_equal_a_dispatch_count(tmp_path, overrides):
    run = ampctl.train([*FAST, *overrides, "train.steps=10", "train.profile=2"], run_dir=tmp_path / "run")
    recorded = run.summary["profile"]["matmul_dtypes"]
    assert recorded["flops_per_step"] == pytest.approx(counted(overrides), rel=1e-9)
    assert sum(recorded["shares"].values()) == pytest.approx(1.0)
    if "precision.rules=[{match:'9',run_in:fp32}]" in overrides:  # the head, kept in fp32 by its rule
        assert set(recorded["flops_per_step"]) == {"bfloat16", "float32"}


def test_a_layer_whose_matmuls_ran_otherwise_than_the_mode_meant_is_named(tmp_path):
    """The last Linear turns autocast off in its forward: bf16's plan says bfloat16, its matmuls ran in float32; the
    run's line says which layer, the record holds it. Without it (the plain MLP), nothing is said."""
    from tests.support.in_process import run_ampctl

    common = [*FAST, "precision=bf16", "train.steps=10", "train.profile=2", "train.console=plain"]
    sneaky = run_ampctl("train", *common, "recipe._target_=tests.support.sneaky_fp32_recipe.SneakyFP32Recipe",
                        f"hydra.run.dir={tmp_path / 'sneaky'}")
    assert sneaky.returncode == 0, sneaky.stderr
    assert "warning: layers whose matmuls ran otherwise than the mode meant: 9 (meant bfloat16, ran float32)" \
        in sneaky.stdout
    summary = json.loads((tmp_path / "sneaky" / "summary.json").read_text())
    assert summary["profile"]["matmul_dtypes"]["ran_otherwise"] == {"9": {"meant": "bfloat16", "ran": "float32"}}
    plain = run_ampctl("train", *common, f"hydra.run.dir={tmp_path / 'plain'}")
    assert "matmul precision: 100.0% of FLOPs in bfloat16" in plain.stdout and "ran otherwise" not in plain.stdout


def test_an_fp8_models_matmuls_are_counted_in_fp8(tmp_path, monkeypatch):
    """precision=fp8 (torchao) on the CPU, with torch's own FP8 matmul (tests/support/fp8_anywhere.py's setting):
    its FP8 aten::mm runs torch._scaled_mm inside, whose operands are what computes. The profiled float8 FLOPs equal
    those of every torch._scaled_mm call of one step, counted by a wrapper around it; each layer's forward ran in
    float8_e4m3fn, as its plan meant."""
    pytest.importorskip("torchao")
    from ampctl.engine.precision import fp8_torchao

    monkeypatch.setattr(fp8_torchao, "unsupported_reason", lambda _device: None)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    gpt = ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
           "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "precision=fp8",
           "precision.options.auto_filter_small_kn=false"]
    run = ampctl.train([*QUIET, *gpt, "train.steps=10", "train.profile=2"], run_dir=tmp_path / "run")
    recorded = run.summary["profile"]["matmul_dtypes"]
    scaled: dict[str, float] = defaultdict(float)
    scaled_mm = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        scaled[str(a.dtype).removeprefix("torch.")] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    cfg, policy, recipe = build(*gpt, base=QUIET)
    with policy:
        state = build_state(cfg, policy, recipe)
        batches = [next(batch_stream(recipe, policy.device, cfg.train.seed))]
        train_step(state, iter(batches), recipe, policy, StepSettings.of(cfg.train),
                   Telemetry(policy.device, 1, recipe.samples_per_batch, None, []))
    float8 = {k: v for k, v in recorded["flops_per_step"].items() if k.startswith("float8")}
    assert float8 and float8 == pytest.approx(dict(scaled), rel=1e-9), (recorded, dict(scaled))
    assert recorded["ran_otherwise"] == {}
    assert all(set(flops) == {"float8_e4m3fn"} for flops in recorded["forward_by_layer"].values())
