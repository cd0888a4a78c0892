"""resnet: torchvision's ResNets on CIFAR-10 (from disk, download only on request) or on synthetic
ImageNet-shaped batches, the classic mixed-precision speed benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from ampctl.errors import ConfigError, UsageError
from ampctl.recipes.base import require_positive
from ampctl.recipes.images import (
    dataset_batches,
    dataset_eval_batches,
    resolve_num_workers,
    synthetic_batches,
    synthetic_eval_batches,
)
from ampctl.recipes.libraries import import_library
from ampctl.recipes.metrics import ImageClassification

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
DATASETS = ("cifar10", "synthetic")
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass
class ResNetRecipe(ImageClassification):
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
        require_positive(self, "batch_size", "image_size")
        last = self.image_size
        for _ in range(5):  # the stem's and four stages' stride-2 layers, each rounding up
            last = -(-last // 2)
        if self.batch_size * last * last < 2:
            raise UsageError(f"recipe.image_size={self.image_size} with recipe.batch_size={self.batch_size}: "
                             f"ResNet's last stage would hold one value per channel ({self.image_size} px halved five "
                             "times), which BatchNorm cannot normalize in training; raise recipe.image_size above 32 "
                             "or recipe.batch_size to 2 or more")
        if self.num_classes is None:
            self.num_classes = 10 if self.data == "cifar10" else 1000
        elif self.num_classes < 2:
            raise ConfigError("recipe.num_classes", self.num_classes, "an integer >= 2, or null")
        self.num_workers = resolve_num_workers(self.num_workers)
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch = None
        self._dataset = self._open_cifar10(train=True) if self.data == "cifar10" else None

    def _open_cifar10(self, train: bool):
        import_library("torchvision", "recipe=resnet")
        from torchvision import datasets, transforms

        root = Path(self.data_root).expanduser()
        if not self.download and not (root / "cifar-10-batches-py").is_dir():
            raise UsageError(
                f"recipe.data_root={self.data_root!r} holds no CIFAR-10 (cifar-10-batches-py/): pass "
                "recipe.download=true to fetch it, or recipe.data=synthetic"
            )
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
        try:
            return datasets.CIFAR10(str(root), train=train, download=self.download, transform=transform)
        except (RuntimeError, OSError) as exc:
            raise UsageError(f"recipe.data_root={self.data_root!r}: CIFAR-10 could not be read: {exc}") from None

    def activation_checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4)  # type: ignore[union-attr]
                for block in stage]

    def build_model(self) -> nn.Module:
        torchvision = import_library("torchvision", "recipe=resnet")

        model = getattr(torchvision.models, self.arch)(weights=None, num_classes=self.num_classes)
        # channels_last lets cuDNN use its fastest half-precision convolution kernels.
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches_from(device, seed, 0)

    def batches_from(self, device: torch.device, seed: int,
                     position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The stream of batches(device, seed) from its position-th batch, reading no image before it."""
        if self._dataset is None:
            return synthetic_batches(self.batch_size, self.image_size, self.num_classes, self.channels_last,
                                     device, seed, position)
        return dataset_batches(self._dataset, self.batch_size, self.num_workers, self.channels_last, device, seed,
                               position)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """CIFAR-10's test set (or held-out synthetic batches)."""
        if self._dataset is None:
            return synthetic_eval_batches(self.batch_size, self.image_size, self.num_classes,  # type: ignore[arg-type]
                                          self.channels_last, device)
        return dataset_eval_batches(self._open_cifar10(train=False), self.batch_size, self.num_workers,
                                    self.channels_last, device)
