"""Images for the vision recipes (resnet, timm): fixed synthetic batches cycled on the device, or a Dataset read
by a DataLoader whose order depends on the seed alone."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
from typing import Iterator, Optional

import torch

from ampctl.errors import ConfigError, UsageError
from ampctl.recipes.metrics import EVAL_SEED

SYNTHETIC_BATCHES = 4  # distinct fixed batches cycled on the device: data costs nothing in speed runs
MAX_DEFAULT_WORKERS = 8  # the default DataLoader workers: one per core this process may use, up to this


class EpochShuffle(torch.utils.data.Sampler):
    """A permutation per epoch drawn from seed + epoch alone (as DistributedSampler's set_epoch): the order of
    the batches does not depend on recipe.num_workers, whose loader draws from its own generator a different
    number of times (persistent workers once, an in-process loader every epoch). It starts at any batch of the
    stream (`start_batch`, of `batch_size` samples, full batches only) without drawing those before it: a resumed
    run's loader reads no image it does not train on. It yields (epoch, index) keys for SeededSamples."""

    def __init__(self, size: int, seed: int, batch_size: int = 1, start_batch: int = 0) -> None:
        self.size, self.seed = size, seed
        self.epoch, skipped = divmod(start_batch, size // batch_size)
        self.skip = skipped * batch_size  # samples of the first epoch already trained on

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        keys = [(self.epoch, index) for index in order.tolist()[self.skip:]]
        self.epoch, self.skip = self.epoch + 1, 0
        return iter(keys)


class SeededSamples(torch.utils.data.Dataset):
    """A map-style dataset whose random transforms (a crop, a flip: timm's draw from Python's `random`, torchvision's
    from torch's) are seeded by the sample's own (seed, epoch, index): every sample of the stream is the same
    whichever worker loads it, how many workers there are, and where the stream started. The loading process's
    random states are put back after each sample (with recipe.num_workers=0 that process is the training one)."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> object:
        epoch, index = key
        with _random_states_seeded(sample_seed(self.seed, epoch, index)):
            return self.dataset[index]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed of one sample's place in the stream, the same on every machine and Python."""
    digest = hashlib.blake2b(f"{seed},{epoch},{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def _random_states_seeded(seed: int) -> Iterator[None]:
    import random

    import numpy as np

    saved = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    try:
        yield
    finally:
        torch.random.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def default_num_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_DEFAULT_WORKERS, cores)


def resolve_num_workers(num_workers: Optional[int]) -> int:
    """recipe.num_workers: null for one per core (up to MAX_DEFAULT_WORKERS), else an integer >= 0."""
    if num_workers is None:
        return default_num_workers()
    if num_workers < 0:
        raise ConfigError("recipe.num_workers", num_workers, "an integer >= 0 (0: load in the training process), "
                          f"or null for one per core up to {MAX_DEFAULT_WORKERS}")
    return num_workers


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def synthetic_batches(batch_size: int, image_size: int, num_classes: int, channels_last: bool,
                      device: torch.device, seed: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """SYNTHETIC_BATCHES fixed (images, labels) batches, normal pixels and uniform labels, cycled on the device
    (from the start-th batch of the cycle)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fixed = [
        (
            torch.randn(batch_size, 3, image_size, image_size, generator=gen,
                        device=device).contiguous(memory_format=memory_format(channels_last)),
            torch.randint(num_classes, (batch_size,), generator=gen, device=device),
        )
        for _ in range(SYNTHETIC_BATCHES)
    ]
    first = start % SYNTHETIC_BATCHES
    return itertools.cycle(fixed[first:] + fixed[:first])


def synthetic_eval_batches(batch_size: int, image_size: int, num_classes: int, channels_last: bool,
                           device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out synthetic batches, distinct from each other and from training's: the same on every call."""
    gen = torch.Generator(device=device).manual_seed(EVAL_SEED)
    while True:
        yield (torch.randn(batch_size, 3, image_size, image_size, generator=gen,
                           device=device).contiguous(memory_format=memory_format(channels_last)),
               torch.randint(num_classes, (batch_size,), generator=gen, device=device))


def dataset_eval_batches(dataset: torch.utils.data.Dataset, batch_size: int, num_workers: int, channels_last: bool,
                         device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A held-out dataset once, in its order (the last batch may be short): the same batches on every call."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                         pin_memory=device.type == "cuda")
    with naming_unreadable_images():
        for x, y in loader:
            yield (x.to(device, non_blocking=True).contiguous(memory_format=memory_format(channels_last)),
                   y.to(device, non_blocking=True))


@contextlib.contextmanager
def naming_unreadable_images() -> Iterator[None]:
    """A file the loader cannot read (not an image, truncated: PIL raises an OSError, re-raised by the
    DataLoader from its worker with the worker's traceback in its text) as one line naming the file."""
    try:
        yield
    except OSError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UsageError(f"the data loader cannot read an image: {lines[-1] if lines else type(exc).__name__}; "
                         "remove or replace the file") from None


def dataset_batches(dataset: torch.utils.data.Dataset, batch_size: int, num_workers: int, channels_last: bool,
                    device: torch.device, seed: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless epochs of a map-style dataset of (image, label): shuffled by seed and epoch, full batches only,
    each sample's random transforms seeded by its place in the stream, loaded by num_workers processes into
    page-locked memory on CUDA so that the copies overlap the step; from the start-th batch, reading none before."""
    loader = torch.utils.data.DataLoader(
        SeededSamples(dataset, seed),
        batch_size=batch_size,
        sampler=EpochShuffle(len(dataset), seed, batch_size, start),  # type: ignore[arg-type]
        drop_last=True,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),  # its workers' seeds, never from the global RNG
        persistent_workers=num_workers > 0,
    )
    with naming_unreadable_images():
        while True:
            for x, y in loader:
                yield (x.to(device, non_blocking=True).contiguous(memory_format=memory_format(channels_last)),
                       y.to(device, non_blocking=True))
