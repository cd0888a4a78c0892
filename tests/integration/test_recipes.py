"""The built-in recipes train (whole runs); the gpt corpus' pure checks stay in tests/unit/test_recipes.py."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UsageError
from tests.support.configs import TINY_GPT
from tests.support.training import QUIET, train_here


@pytest.mark.parametrize("precision", ["bf16", "O2"])
def test_tiny_gpt_learns_the_stdlib_corpus(tmp_path, precision):
    summary, rows = train_here(tmp_path, *TINY_GPT, f"precision={precision}", "train.steps=40", "optimizer.lr=0.003",
                         base=QUIET)
    assert summary["tail_loss"] < rows[0]["loss"] - 1.0  # from ~ln(256)=5.5 towards the byte statistics
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32, rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resnet18_on_synthetic_batches(tmp_path, precision):
    summary, rows = train_here(
        tmp_path, "recipe=resnet", "recipe.data=synthetic", "recipe.image_size=32", "recipe.batch_size=4",
        "recipe.num_classes=10", f"precision={precision}", "train.steps=3", "train.log_every=3",
        base=QUIET,
    )
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert summary["parameters"] > 11_000_000


def test_cifar10_is_not_downloaded_without_consent(tmp_path):
    with pytest.raises(UsageError, match="holds no CIFAR-10.*recipe.download=true"):
        train_here(tmp_path, "recipe=resnet", f"recipe.data_root={tmp_path / 'nothing'}", base=QUIET)
    assert not (tmp_path / "nothing").exists()



def test_a_dataset_reads_the_same_batches_through_worker_processes_as_in_the_loop(monkeypatch):
    """resnet's DataLoader path (CIFAR-10's, with a stand-in dataset: the real one checks its files' md5): the
    batches do not depend on recipe.num_workers, come out channels_last, and the stream is endless (epochs)."""
    from ampctl.recipes.resnet import ResNetRecipe

    images = torch.arange(10 * 3 * 4 * 4, dtype=torch.float32).reshape(10, 3, 4, 4)
    dataset = torch.utils.data.TensorDataset(images, torch.arange(10))
    monkeypatch.setattr(ResNetRecipe, "_open_cifar10", lambda self, train: dataset)
    streams = {}
    for workers in (0, 2):
        recipe = ResNetRecipe(batch_size=4, num_workers=workers)
        batches = recipe.batches(torch.device("cpu"), seed=3)
        streams[workers] = [next(batches) for _ in range(5)]  # 2 batches an epoch (drop_last): 2.5 epochs
    for (x0, y0), (x2, y2) in zip(streams[0], streams[2]):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
        assert x0.is_contiguous(memory_format=torch.channels_last) and torch.equal(x0, images[y0])
    assert ResNetRecipe(data="synthetic").num_workers >= 1
    with pytest.raises(Exception, match=r"recipe.num_workers"):
        ResNetRecipe(data="synthetic", num_workers=-1)
