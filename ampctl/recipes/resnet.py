"""resnet: torchvision's ResNets on CIFAR-10 (from disk, download only on request) or on synthetic
ImageNet-shaped batches, the classic mixed-precision speed benchmark."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.errors import ConfigError, UsageError

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
DATASETS = ("cifar10", "synthetic")
SYNTHETIC_BATCHES = 4  # distinct fixed batches cycled on the device: data costs nothing in speed runs
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MAX_DEFAULT_WORKERS = 8  # the default DataLoader workers: one per core this process may use, up to this


class EpochShuffle(torch.utils.data.Sampler):
    """A permutation per epoch drawn from seed + epoch alone (as DistributedSampler's set_epoch): the order of
    the batches does not depend on recipe.num_workers, whose loader draws from its own generator a different
    number of times (persistent workers once, an in-process loader every epoch)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.epoch += 1
        return iter(order.tolist())


def default_num_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_DEFAULT_WORKERS, cores)


@dataclass
class ResNetRecipe:
    arch: str = "resnet18"
    data: str = "cifar10"
    data_root: str = "data/cifar10"
    download: bool = False
    batch_size: int = 128
    image_size: int = 224
    num_classes: Optional[int] = None
    channels_last: bool = True
    num_workers: Optional[int] = None  # cifar10's DataLoader worker processes; null: default_num_workers()

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError("recipe.arch", self.arch, " | ".join(ARCHS))
        if self.data not in DATASETS:
            raise ConfigError("recipe.data", self.data, " | ".join(DATASETS))
        for key in ("batch_size", "image_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"recipe.{key}", getattr(self, key), "an integer >= 1")
        if self.num_classes is None:
            self.num_classes = 10 if self.data == "cifar10" else 1000
        elif self.num_classes < 2:
            raise ConfigError("recipe.num_classes", self.num_classes, "an integer >= 2, or null")
        if self.num_workers is None:
            self.num_workers = default_num_workers()
        elif self.num_workers < 0:
            raise ConfigError("recipe.num_workers", self.num_workers, "an integer >= 0 (0: load in the training "
                              "process), or null for one per core up to 8")
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch = None
        self._dataset = self._open_cifar10() if self.data == "cifar10" else None

    def _open_cifar10(self):
        from torchvision import datasets, transforms

        root = Path(self.data_root).expanduser()
        if not self.download and not (root / "cifar-10-batches-py").is_dir():
            raise UsageError(
                f"recipe.data_root={self.data_root!r} holds no CIFAR-10 (cifar-10-batches-py/): pass "
                "recipe.download=true to fetch it, or recipe.data=synthetic"
            )
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
        try:
            return datasets.CIFAR10(str(root), train=True, download=self.download, transform=transform)
        except (RuntimeError, OSError) as exc:
            raise UsageError(f"recipe.data_root={self.data_root!r}: CIFAR-10 could not be read: {exc}") from None

    def activation_checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4)  # type: ignore[union-attr]
                for block in stage]

    def build_model(self) -> nn.Module:
        import torchvision

        model = getattr(torchvision.models, self.arch)(weights=None, num_classes=self.num_classes)
        # channels_last lets cuDNN use its fastest half-precision convolution kernels.
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        if self._dataset is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            fixed = [
                (
                    torch.randn(self.batch_size, 3, self.image_size, self.image_size, generator=gen,
                                device=device).contiguous(memory_format=memory_format),
                    torch.randint(self.num_classes, (self.batch_size,), generator=gen, device=device),
                )
                for _ in range(SYNTHETIC_BATCHES)
            ]
            yield from itertools.cycle(fixed)
            return
        loader = torch.utils.data.DataLoader(
            self._dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(self._dataset), seed),
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=device.type == "cuda",  # page-locked batches: the copies below overlap the step
            generator=torch.Generator().manual_seed(seed),  # its workers' seeds, never from the global RNG
            persistent_workers=self.num_workers > 0,
        )
        while True:
            for x, y in loader:
                yield (
                    x.to(device, non_blocking=True).contiguous(memory_format=memory_format),
                    y.to(device, non_blocking=True),
                )

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)
