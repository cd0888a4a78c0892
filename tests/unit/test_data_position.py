"""A DataLoader recipe's stream starts at any batch (recipes/images.py): the batches from position k are the
stream's k-th on, across epochs, whatever the workers, and no sample before k is loaded; each sample's random
transforms are its own (seeded by its place), and loading leaves the training process's random states as they
were. recipes/base.starts_anywhere says when a recipe's batches_from may stand for its batches."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ampctl.engine.loop import batch_stream
from ampctl.engine.parallel import RankShard
from ampctl.recipes.base import starts_anywhere
from ampctl.recipes.images import dataset_batches


class Augmented(torch.utils.data.Dataset):
    """Ten samples with a 'transform' that draws from torch's and Python's random states, counting its loads."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.loaded.append(index)
        return torch.full((2,), float(index)) + 0.5 * torch.rand(2) + 0.4 * random.random(), index % 3


def _take(stream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(stream, n))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


def test_the_stream_from_any_batch_is_the_streams_own_across_epochs_and_workers():
    cpu = torch.device("cpu")
    whole = _take(dataset_batches(Augmented(), 3, 0, False, cpu, seed=7), 9)  # 3 full batches an epoch
    for start in (1, 3, 4, 8):
        assert _same(_take(dataset_batches(Augmented(), 3, 0, False, cpu, seed=7, start=start), 9 - start),
                     whole[start:]), start
    # the same samples, the same transforms, loaded in two worker processes
    assert _same(_take(dataset_batches(Augmented(), 3, 2, False, cpu, seed=7, start=4), 5), whole[4:])
    assert not _same(_take(dataset_batches(Augmented(), 3, 0, False, cpu, seed=8), 9), whole)  # the seed's stream


def test_a_stream_started_later_loads_no_sample_before_it_and_keeps_the_training_random_states():
    dataset = Augmented()
    torch.manual_seed(123)
    random.seed(123)
    before = torch.random.get_rng_state(), random.getstate()
    first = next(dataset_batches(dataset, 3, 0, False, torch.device("cpu"), seed=7, start=5))
    assert len(dataset.loaded) == 3 and sorted(dataset.loaded) == sorted(first[0][:, 0].floor().long().tolist())
    assert torch.equal(torch.random.get_rng_state(), before[0]) and random.getstate() == before[1]


def test_batches_from_stands_for_batches_only_where_its_class_defines_both_or_inherits_batches():
    from ampctl.recipes.mlp import MLPRecipe
    from ampctl.recipes.resnet import ResNetRecipe

    class Delayed(ResNetRecipe):  # changes batches alone: its inherited batches_from would skip the change
        def batches(self, device, seed):
            yield from super().batches(device, seed)

    class Both(Delayed):
        def batches_from(self, device, seed, position):
            return super().batches_from(device, seed, position)

    assert starts_anywhere(ResNetRecipe(data="synthetic", image_size=8)) and not starts_anywhere(MLPRecipe())
    assert not starts_anywhere(Delayed(data="synthetic", image_size=8))
    assert starts_anywhere(Both(data="synthetic", image_size=8))
    recipe = ResNetRecipe(data="synthetic", image_size=8, batch_size=4)
    shard = RankShard(recipe, rank=1, world_size=2)
    assert starts_anywhere(shard) and not starts_anywhere(RankShard(MLPRecipe(), 0, 2))
    cpu = torch.device("cpu")
    whole = _take(shard.batches(cpu, 0), 6)
    assert _same(_take(batch_stream(shard, cpu, 0, position=3), 3), whole[3:])
    assert whole[0][0].shape[0] == 2  # the rank's half of each batch


@pytest.mark.parametrize("position", [0, 5])
def test_a_recipe_without_batches_from_is_replayed(position):
    from ampctl.recipes.mlp import MLPRecipe

    recipe, cpu = MLPRecipe(hidden=8), torch.device("cpu")
    whole = _take(recipe.batches(cpu, 3), 8)
    assert _same(_take(batch_stream(recipe, cpu, 3, position), 8 - position), whole[position:])
