"""NVFP4's training recipe in real runs: `precision=nvfp4_recipe` trains, and its stochastic rounding draws by
train.seed, the step and the call (never by what the process ran before), so that a resumed run equals the
uninterrupted one bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ampctl.cli import main
from tests.support.runs import rows

# two micro-batches a step: each backward draws its own bits; dimensions that are not multiples of 16 (padding)
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=40", "recipe.batch_size=24", "precision=nvfp4_recipe",
       "train.steps=6", "train.grad_accum_steps=2", "train.checkpoint.every=3", "train.log_every=1",
       "train.console=quiet", "telemetry.profile_cpu_memory=false"]


def weights(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


def test_a_resumed_recipe_run_equals_the_uninterrupted_one(tmp_path, restore_argv):
    whole, halves, nearest = tmp_path / "whole", tmp_path / "halves", tmp_path / "nearest"
    main(["train", *RUN, f"hydra.run.dir={whole}"])
    main(["train", *RUN, "train.steps=3", f"hydra.run.dir={halves}"])
    main(["train", *RUN, f"hydra.run.dir={halves}", "resume=auto"])
    assert rows(whole) == rows(halves) and len(rows(whole)) == 6
    final, resumed = weights(whole, 6), weights(halves, 6)
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    # the draws matter: the same run rounding its gradients to nearest trains otherwise from its first update on
    main(["train", *RUN, "precision.options.stochastic_rounding=false", f"hydra.run.dir={nearest}"])
    assert rows(nearest)[0]["loss"] == rows(whole)[0]["loss"] and rows(nearest)[1:] != rows(whole)[1:]
    log = (whole / "train.log").read_text()
    assert "weights_2d rht signs=" in log and "stochastic_rounding" in log  # the sign vector is in the run's record
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["precision"] == "nvfp4_recipe" and "rht signs=" in summary["converter"]["described"]
    assert summary["converter"]["described"] == json.loads((halves / "summary.json").read_text())["converter"][
        "described"]  # the same sign vector after the resume
