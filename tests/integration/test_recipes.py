"""The built-in recipes train (whole runs); the gpt corpus' pure checks stay in tests/unit/test_recipes.py."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UsageError
from tests.conftest import QUIET, train
from tests.unit.test_recipes import TINY_GPT


@pytest.mark.parametrize("precision", ["bf16", "O2"])
def test_tiny_gpt_learns_the_stdlib_corpus(tmp_path, precision):
    summary, rows = train(tmp_path, *TINY_GPT, f"precision={precision}", "train.steps=40", "optimizer.lr=0.003",
                         base=QUIET)
    assert summary["tail_loss"] < rows[0]["loss"] - 1.0  # from ~ln(256)=5.5 towards the byte statistics
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32, rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resnet18_on_synthetic_batches(tmp_path, precision):
    summary, rows = train(
        tmp_path, "recipe=resnet", "recipe.data=synthetic", "recipe.image_size=32", "recipe.batch_size=4",
        "recipe.num_classes=10", f"precision={precision}", "train.steps=3", "train.log_every=3",
        base=QUIET,
    )
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert summary["parameters"] > 11_000_000


def test_cifar10_is_not_downloaded_without_consent(tmp_path):
    with pytest.raises(UsageError, match="holds no CIFAR-10.*recipe.download=true"):
        train(tmp_path, "recipe=resnet", f"recipe.data_root={tmp_path / 'nothing'}", base=QUIET)
    assert not (tmp_path / "nothing").exists()

