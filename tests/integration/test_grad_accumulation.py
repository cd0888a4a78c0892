"""precision.grad_accum_dtype=float32 (engine/precision/half.FP32GradAccumulation): with half weights, the
micro-batch gradients add up in fp32. Against hand-written loops on ampctl's own built state: one that sums each
micro-batch's gradient (torch.autograd.grad, so .grad never accumulates) in fp32 and hands the optimizer that sum
(rounded once to the weights' type; O2: as its masters' gradients) gives the same weights bit for bit; the run
without the option equals the loop that accumulates in the half type, and the two differ."""

from __future__ import annotations

import json

import pytest
import torch

import ampctl
from ampctl.engine.build import build_state
from ampctl.engine.loop import batch_stream
from tests.support.training import FAST, build

ACCUM = 4
STEPS = 3
RUN = ["recipe.norm=none", "train.grad_accum_steps=4", f"train.steps={STEPS}", "train.clip_grad_norm=null",
       "train.lr.schedule=constant", "optimizer=sgd", "optimizer.lr=0.5", "scaler=none"]
MODES = {"bf16_true": ["precision=bf16_true"], "O3-bf16": ["precision=O3", "precision.dtype=bfloat16"],
         "O2-bf16": ["precision=O2", "precision.dtype=bfloat16", "recipe.norm=layernorm"]}  # its norms: own masters


def by_hand(overrides: list[str], in_fp32: bool) -> dict[str, torch.Tensor]:
    """STEPS steps of ACCUM micro-batches on ampctl's built state (init, casts, optimizer), the accumulation by hand."""
    cfg, policy, recipe = build(*RUN, *overrides)
    with policy:
        state = build_state(cfg, policy, recipe)
        trainable = [p for p in state.model.parameters() if p.requires_grad]
        stepped = state.weights.optimizer_params  # the masters under O2, in the model's order
        batches = batch_stream(recipe, policy.device, cfg.train.seed)
        for _ in range(STEPS):
            sums = [torch.zeros_like(p, dtype=torch.float32 if in_fp32 else p.dtype) for p in trainable]
            for _ in range(ACCUM):
                loss = recipe.loss(state.model, next(batches)) / ACCUM
                for total, grad in zip(sums, torch.autograd.grad(loss, trainable)):
                    total.add_(grad)
            for target, total in zip(stepped, sums):
                target.grad = total.to(target.dtype)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.weights.masters_to_model()
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def by_ampctl(tmp_path, overrides: list[str], in_fp32: bool) -> dict[str, torch.Tensor]:
    extra = ["precision.grad_accum_dtype=float32"] if in_fp32 else []
    run = ampctl.train([*FAST, *RUN, *overrides, *extra], run_dir=tmp_path / ("fp32" if in_fp32 else "half"))
    checkpoint = torch.load(run.run_dir / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)
    return checkpoint["model"]


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("mode", list(MODES))
def test_fp32_accumulation_equals_a_hand_written_fp32_sum_and_half_equals_a_half_sum(tmp_path, mode):
    overrides = MODES[mode]
    fp32 = by_ampctl(tmp_path, overrides, in_fp32=True)
    half = by_ampctl(tmp_path, overrides, in_fp32=False)
    assert same_bits(fp32, by_hand(overrides, in_fp32=True))
    assert same_bits(half, by_hand(overrides, in_fp32=False))
    assert not same_bits(fp32, half)  # the option changes what the optimizer sees


def test_a_dtype_that_is_not_float32_is_refused_in_one_line(tmp_path):
    from tests.support.in_process import run_ampctl

    done = run_ampctl("train", "device=cpu", "recipe=mlp", "precision=bf16_true", "precision.grad_accum_dtype=int8",
                      f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "precision.grad_accum_dtype='int8' is not allowed: expected float32 (an fp32 gradient per parameter), or " \
           "null for the weights' own type" in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_summary_of_an_fp32_accumulating_run(tmp_path):
    run = ampctl.train(["device=cpu", "recipe=mlp", "recipe.hidden=32", "train.console=quiet", "train.steps=2",
                        "precision=bf16_true", "train.grad_accum_steps=2", "precision.grad_accum_dtype=float32"],
                       run_dir=tmp_path / "run")
    config = json.loads((run.run_dir / "identity.json").read_text())["config"]
    assert config["precision"]["grad_accum_dtype"] == "float32"


def test_memory_counts_the_fp32_buffers_4_bytes_a_half_weight(tmp_path):
    """bf16_true keeps a buffer per parameter (4 bytes each, counted by hand on the recipe's model); O2's sums are its
    master gradients, counted there already: no buffer."""
    from ampctl.recipes.mlp import MLPRecipe

    params = sum(p.numel() for p in MLPRecipe(hidden=64, norm="none").build_model().parameters())
    common = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "recipe.norm=none", "train.grad_accum_steps=2",
              "precision.grad_accum_dtype=float32", "telemetry.profile_cpu_memory=false"]
    for mode, expected in (("bf16_true", 4 * params), ("O2", 0)):
        extra = ["recipe.norm=layernorm"] if mode == "O2" else []
        result = ampctl.memory([*common, f"precision={mode}", *extra], out_dir=tmp_path / mode)
        (row,) = result.summary["rows"]
        assert row.get("grad_accumulators_bytes", 0) == expected, mode  # a column only where a row keeps buffers


def test_a_distributed_run_is_refused_in_one_line(tmp_path):
    """Under torchrun (its variables set: refused before any process group starts)."""
    from tests.support.in_process import run_ampctl

    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    done = run_ampctl("train", "device=cpu", "recipe=mlp", "precision=bf16_true", "distributed=ddp",
                      "train.grad_accum_steps=2", "precision.grad_accum_dtype=float32",
                      f"hydra.run.dir={tmp_path / 'run'}", env=torchrun)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert ("precision.grad_accum_dtype=float32 with distributed=ddp and precision=bf16_true: not supported yet"
            in done.stderr)


@pytest.mark.slow
def test_under_fsdp_float32_accumulation_is_fsdps_own(tmp_path):
    """FSDP2 keeps fp32 sharded parameters and reduces (and accumulates unsynced micro-batches) in its reduce dtype,
    float32: the option is accepted and the run is the same run, step for step, bit for bit."""
    from tests.support.runs import rows, torchrun

    run = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "recipe.batch_size=8", "precision=bf16",
           "train.grad_accum_steps=3", "train.steps=6", "train.log_every=1", "train.console=quiet",
           "distributed=fsdp", "telemetry.profile_cpu_memory=false"]
    plain = torchrun(tmp_path / "plain", *run)
    assert plain.returncode == 0, plain.stderr
    fp32 = torchrun(tmp_path / "fp32", *run, "precision.grad_accum_dtype=float32")
    assert fp32.returncode == 0, fp32.stderr
    assert "reduce_dtype=float32" in (tmp_path / "fp32" / "train.log").read_text()
    assert rows(tmp_path / "fp32") == rows(tmp_path / "plain") and len(rows(tmp_path / "plain")) == 6
