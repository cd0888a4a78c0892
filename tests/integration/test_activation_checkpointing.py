"""Activation checkpointing changes memory and time, never the numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ampctl.errors import UsageError
from tests.conftest import QUIET, train

TINY_GPT = ["recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
            "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "train.steps=6"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "O2"])
def test_gpt_losses_are_identical_with_activation_checkpointing(tmp_path, precision):
    _, plain = train(tmp_path / "plain", *TINY_GPT, f"precision={precision}", base=QUIET)
    _, ckpt = train(tmp_path / "ckpt", *TINY_GPT, f"precision={precision}", "train.activation_checkpointing=true",
                    base=QUIET)
    assert [r["loss"] for r in ckpt] == [r["loss"] for r in plain]
    assert [r["loss_scale"] for r in ckpt] == [r["loss_scale"] for r in plain]


def test_resnet_blocks_are_checkpointed_under_autocast(tmp_path):
    args = ["recipe=resnet", "recipe.data=synthetic", "recipe.image_size=32", "recipe.batch_size=4",
            "recipe.num_classes=10", "precision=bf16", "train.steps=2"]
    _, plain = train(tmp_path / "plain", *args, base=QUIET)
    _, ckpt = train(tmp_path / "ckpt", *args, "train.activation_checkpointing=true", base=QUIET)
    assert [r["loss"] for r in ckpt] == [r["loss"] for r in plain]


def test_a_recipe_without_blocks_is_refused(tmp_path):
    with pytest.raises(UsageError, match="recipe MLPRecipe names no blocks to checkpoint"):
        train(tmp_path, "train.activation_checkpointing=true")


def test_it_lowers_the_measured_peak_of_an_activation_heavy_run(tmp_path):
    """Each run in its own process: on a CPU the peak is the process's max RSS."""
    heavy = ["recipe=gpt", "recipe.d_model=128", "recipe.n_layers=8", "recipe.n_heads=4", "recipe.block_size=512",
             "recipe.batch_size=16", "recipe.max_corpus_bytes=1000000", "precision=bf16", "train.steps=2",
             "train.console=quiet"]
    peaks = {}
    for flag in ("false", "true"):
        run_dir = tmp_path / flag
        subprocess.run([sys.executable, "-m", "ampctl", "train", *heavy, f"train.activation_checkpointing={flag}",
                        f"hydra.run.dir={run_dir}"], check=True, capture_output=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
        peaks[flag] = json.loads((run_dir / "summary.json").read_text())["peak_memory_bytes"]
    assert peaks["true"] < peaks["false"] - 50 * 2**20, peaks
