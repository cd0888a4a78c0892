"""Activation checkpointing changes memory and time, never the numbers (its lower peak: test_memory_command)."""

from __future__ import annotations

import pytest

from ampctl.errors import UsageError
from tests.support.training import QUIET, train_here

TINY_GPT = ["recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
            "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "train.steps=6"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "O2"])
def test_gpt_losses_are_identical_with_activation_checkpointing(tmp_path, precision):
    _, plain = train_here(tmp_path / "plain", *TINY_GPT, f"precision={precision}", base=QUIET)
    _, ckpt = train_here(tmp_path / "ckpt", *TINY_GPT, f"precision={precision}", "train.activation_checkpointing=true",
                    base=QUIET)
    assert [r["loss"] for r in ckpt] == [r["loss"] for r in plain]
    assert [r["loss_scale"] for r in ckpt] == [r["loss_scale"] for r in plain]


def test_resnet_blocks_are_checkpointed_under_autocast(tmp_path):
    args = ["recipe=resnet", "recipe.data=synthetic", "recipe.image_size=32", "recipe.batch_size=4",
            "recipe.num_classes=10", "precision=bf16", "train.steps=2"]
    _, plain = train_here(tmp_path / "plain", *args, base=QUIET)
    _, ckpt = train_here(tmp_path / "ckpt", *args, "train.activation_checkpointing=true", base=QUIET)
    assert [r["loss"] for r in ckpt] == [r["loss"] for r in plain]


def test_a_recipe_without_blocks_is_refused(tmp_path):
    with pytest.raises(UsageError, match="recipe MLPRecipe names no blocks to checkpoint"):
        train_here(tmp_path, "train.activation_checkpointing=true")
