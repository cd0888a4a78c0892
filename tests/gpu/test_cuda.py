"""CUDA-only behaviour: parity with the canonical loop on the GPU, no host sync in the step, TF32 for real.
Marked `gpu`; skipped cleanly on a machine without CUDA (see conftest)."""

from __future__ import annotations

import pytest
import torch

from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, train_step
from ampctl.engine.precision import fp32_math
from ampctl.engine.telemetry import Telemetry
from tests.support.golden import GOLDEN, canonical_loop
from tests.support.training import QUIET, build, train_here

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision,dtype,use_scaler", [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False)])
def test_cuda_losses_and_scales_match_the_canonical_loop(tmp_path, precision, dtype, use_scaler):
    _, rows = train_here(tmp_path, f"precision={precision}", "device=cuda", *GOLDEN)
    losses, scales, _ = canonical_loop(dtype, use_scaler, device="cuda")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5)
    assert [r["loss_scale"] for r in rows] == scales


@pytest.mark.parametrize("precision", ["fp16", "bf16", "O2", "O3"])
def test_a_step_never_syncs_the_host_with_fused_optimizers(precision):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call inside the step (the fp32 weight
    average's update included)."""
    cfg, policy, recipe = build(f"precision={precision}", "device=cuda", "train.ema.decay=0.99",
                                "scaler.init_scale=1e20" if precision in ("fp16", "O2") else "train.seed=0")
    with policy:
        state = build_state(cfg, policy, recipe)
        telemetry = Telemetry(policy.device, 100, recipe.samples_per_batch, None, [])
        batches = recipe.batches(policy.device, 0)
        train_step(state, batches, recipe, policy, StepSettings(2, 1.0), telemetry)  # warm-up: lazy inits may sync once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                train_step(state, batches, recipe, policy, StepSettings(2, 1.0), telemetry)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_tf32_mode_enables_tf32_for_the_run_only(tmp_path):
    if not torch.cuda.get_device_capability() >= (8, 0):
        pytest.skip("TF32 needs compute capability 8.0+")
    before = fp32_math.snapshot()
    _, policy, _ = build("precision=tf32", "device=cuda")
    with policy:
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert fp32_math.snapshot() == before
    summary, _ = train_here(tmp_path, "precision=tf32", "device=cuda", "train.steps=5")
    assert summary["device"] == "cuda"


def test_o2_batchnorm_runs_fp32_parameters_on_half_input_without_casts(tmp_path):
    """cuDNN's batch norm takes fp16 input with fp32 parameters: O2 keeps BN in fp32 without the two
    casting passes per layer that the other norm layers need."""
    cfg, policy, recipe = build("precision=O2", "device=cuda", "recipe=resnet", "recipe.data=synthetic",
                                "recipe.image_size=32", "recipe.batch_size=8")
    with policy:
        state = build_state(cfg, policy, recipe)
        bn = state.model.bn1
        assert bn.weight.dtype == torch.float32 and not bn._forward_pre_hooks
        seen = []
        bn.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
        telemetry = Telemetry(policy.device, 100, recipe.samples_per_batch, None, [])
        train_step(state, recipe.batches(policy.device, 0), recipe, policy, StepSettings(1, 1.0), telemetry)
    assert seen == [(torch.float16, torch.float16)]


@pytest.mark.parametrize("kind,precision", [("ddp", "fp16"), ("fsdp", "bf16")])
def test_data_parallel_on_cuda_with_nccl(tmp_path, kind, precision):
    """torchrun with one process per GPU (as many as there are, at most 2): the nccl path end to end."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    nproc = min(torch.cuda.device_count(), 2)
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "ampctl",
         "train", f"distributed={kind}", "device=cuda", f"precision={precision}", "recipe=gpt",
         "recipe.max_corpus_bytes=300000", "train.steps=20", "train.log_every=5", "train.console=plain",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300, cwd=repo,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == nproc and summary["device"] == "cuda"
    assert f"{kind} over {nproc} ranks (nccl)" in result.stdout or nproc == 1


def test_fp8_trains_its_large_linears_on_fp8_tensor_cores(tmp_path):
    """precision=fp8 as a user runs it: torchao's size filter, torch.compile, FP8 tensor cores."""
    from ampctl.engine.precision import fp8_torchao

    if (reason := fp8_torchao.unsupported_reason(torch.device("cuda"))) is not None:
        pytest.skip(f"precision=fp8 {reason}")
    shape = ["recipe=gpt2", "recipe.n_layers=2", "recipe.block_size=256", "recipe.max_corpus_bytes=300000",
             "train.steps=30"]
    compiled = ["device=cuda", "train.compile.enabled=true", *shape]
    _, bf16 = train_here(tmp_path / "bf16", "precision=bf16", *compiled, base=QUIET)
    _, fp8 = train_here(tmp_path / "fp8", "precision=fp8", *compiled, base=QUIET)
    assert fp8[-1]["loss"] < fp8[0]["loss"] - 1.0
    assert abs(fp8[-1]["loss"] - bf16[-1]["loss"]) < 0.1, (fp8[-1]["loss"], bf16[-1]["loss"])


@pytest.mark.parametrize("precision", ["bf16", "fp16", "O2"])
def test_the_layer_table_says_what_forward_hooks_see_on_cuda(precision):
    """On CUDA autocast runs layer_norm and group_norm in fp32 (its fp32 list), unlike a CPU: the table says each
    layer as the GPU runs it."""
    from tests.support.layer_zoo import check_the_layer_table_against_hooks

    check_the_layer_table_against_hooks(precision, "device=cuda")


def test_cuda_graphs_train_and_evaluate_a_compiled_gpt(tmp_path):
    """compile_mode=reduce-overhead (CUDA graphs) through training steps and evaluations: on an H100 it failed at
    the first evaluation ("accessing tensor output of CUDAGraphs that has been overwritten") until each forward of
    the model began a new CUDA-graph step; its losses follow the eager run's."""
    import json

    from tests.support.configs import TINY_GPT
    from tests.support.training import QUIET

    args = ["device=cuda", "precision=bf16", *TINY_GPT, "train.steps=12", "train.eval.every=4"]
    _, eager = train_here(tmp_path / "eager", *args, base=QUIET)
    _, graphed = train_here(tmp_path / "graphed", *args, "train.compile.enabled=true",
                            "train.compile.mode=reduce-overhead", base=QUIET)
    assert [r["loss"] for r in graphed] == pytest.approx([r["loss"] for r in eager], rel=2e-2)
    evals = [json.loads(line) for line in (tmp_path / "graphed" / "evals.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [4, 8, 12]
