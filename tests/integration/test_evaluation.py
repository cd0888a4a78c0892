"""Evaluation in the loop (train.eval.every): it never changes training (bit-exact against the canonical torch.amp
loop and against the same run without it: RNG, data stream, BatchNorm statistics, FP8 amax histories), and its
metrics equal an independent computation of the same metrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ampctl.recipes.mlp import MLPRecipe
from tests.support.golden import GOLDEN, STEPS, canonical_loop
from tests.support.training import QUIET, train_here

EVAL = ["train.eval.every=4", "train.eval.batches=3", "train.eval.fp32=true"]


def evals(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]


def independent_metrics(model: torch.nn.Module, recipe: MLPRecipe, dtype, batches: int) -> dict[str, float]:
    """Mean cross-entropy and top-1 accuracy over the held-out batches, computed here (not by ampctl's code)."""
    losses, correct, count = [], 0, 0
    held_out = recipe.eval_batches(torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        for _ in range(batches):
            x, y = next(held_out)
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = model(x)
            losses.append(F.cross_entropy(logits.float(), y, reduction="sum").item())
            correct += (logits.argmax(-1) == y).sum().item()
            count += y.numel()
    return {"loss": sum(losses) / count, "accuracy": correct / count}


@pytest.mark.parametrize("precision,dtype,use_scaler", [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False),
                                                        ("fp32", None, False)])
def test_training_with_evaluation_is_bit_exact_with_the_canonical_loop_and_its_metrics_are_right(
        tmp_path, precision, dtype, use_scaler):
    _, rows = train_here(tmp_path, f"precision={precision}", *GOLDEN, *EVAL)
    losses, scales, model = canonical_loop(dtype or torch.bfloat16, use_scaler) if dtype else _fp32_loop()
    assert [r["loss"] for r in rows] == losses
    assert [r["loss_scale"] for r in rows] == scales
    got = evals(tmp_path)
    assert [e["step"] for e in got] == [4, 8, 12]
    expected = independent_metrics(model, MLPRecipe(hidden=64, batch_size=32), dtype, batches=3)
    assert got[-1]["eval/loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert got[-1]["eval/accuracy"] == expected["accuracy"]
    in_fp32 = independent_metrics(model, MLPRecipe(hidden=64, batch_size=32), None, batches=3)
    assert got[-1]["eval_fp32/loss"] == pytest.approx(in_fp32["loss"], rel=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval"] == {k: v for k, v in got[-1].items() if k != "seconds"}


def _fp32_loop():
    """The canonical loop without autocast or scaler: true fp32."""
    recipe = MLPRecipe(hidden=64, batch_size=32)
    torch.manual_seed(3)
    model = recipe.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = recipe.batches(torch.device("cpu"), seed=3)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = recipe.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [1.0] * STEPS, model


@pytest.mark.parametrize("overrides", [
    ["recipe=mlp", "recipe.norm=batchnorm", "recipe.hidden=32", "recipe.batch_size=16", "precision=bf16"],
    ["recipe=gpt", "recipe._target_=tests.support.eval_recipes.RandomEvalGPT", "recipe.dropout=0.2",
     "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32", "recipe.batch_size=4",
     "recipe.max_corpus_bytes=100000", "precision=fp16"],
    ["recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "precision=fp8_emulated",
     "precision.options.scaling=delayed"],
    ["recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "precision=O2"],
], ids=["batchnorm", "dropout", "fp8-delayed-amax", "O2"])
def test_evaluation_never_changes_training(tmp_path, overrides):
    """BatchNorm running statistics, dropout's RNG, FP8's amax history, O2's masters: the same run with and without
    evaluations after every other step records the same losses, bit for bit, and ends with the same weights."""
    common = [*QUIET, *overrides, "train.steps=8"]
    _, plain = train_here(tmp_path / "plain", *common, base=[])
    _, evaluated = train_here(tmp_path / "evaluated", *common, "train.eval.every=2", "train.eval.fp32="
                         + ("false" if "precision=fp8_emulated" in overrides else "true"), base=[])
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in evaluated] == [r["grad_norm"] for r in plain]
    weights = [torch.load(next((tmp_path / name / "checkpoints").glob("step_*.pt")), weights_only=True)["model"]
               for name in ("plain", "evaluated")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert len(evals(tmp_path / "evaluated")) == 4


def test_a_language_model_reports_perplexity_of_its_mean_token_loss(tmp_path):
    gpt = ["recipe=gpt", "recipe.d_model=32", "recipe.n_layers=1", "recipe.n_heads=2", "recipe.block_size=32",
           "recipe.batch_size=4", "recipe.max_corpus_bytes=100000"]
    train_here(tmp_path, *QUIET, *gpt, "train.steps=2", "train.eval.every=2", "train.eval.batches=2", base=[])
    (row,) = evals(tmp_path)
    assert row["eval/perplexity"] == pytest.approx(math.exp(row["eval/loss"]))
    assert 0 <= row["eval/accuracy"] <= 1
