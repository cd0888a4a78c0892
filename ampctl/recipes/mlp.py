"""mlp: a small MLP classifier on synthetic data labelled by a fixed random teacher network.

Trains in seconds on a CPU and its loss really goes down, which makes it the test workhorse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.errors import ConfigError
from ampctl.recipes.base import require_positive
from ampctl.recipes.metrics import EVAL_SEED, classification_sums

NORMS = {"layernorm": nn.LayerNorm, "batchnorm": nn.BatchNorm1d, "none": None}


@dataclass
class MLPRecipe:
    in_features: int = 64
    hidden: int = 256
    depth: int = 3
    num_classes: int = 10
    batch_size: int = 128
    norm: str = "layernorm"

    def __post_init__(self) -> None:
        require_positive(self, "in_features", "hidden", "depth", "batch_size")
        if self.num_classes < 2:
            raise ConfigError("recipe.num_classes", self.num_classes, "an integer >= 2")
        if self.norm not in NORMS:
            raise ConfigError("recipe.norm", self.norm, " | ".join(NORMS))
        if self.norm == "batchnorm" and self.batch_size < 2:  # its training statistics need two samples
            raise ConfigError("recipe.batch_size", self.batch_size, "an integer >= 2 with recipe.norm=batchnorm")
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch: Optional[int] = None

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.in_features
        for _ in range(self.depth):
            layers.append(nn.Linear(width, self.hidden))
            if NORMS[self.norm] is not None:
                layers.append(NORMS[self.norm](self.hidden))
            layers.append(nn.GELU())
            width = self.hidden
        layers.append(nn.Linear(width, self.num_classes))
        return nn.Sequential(*layers)

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The teacher is fixed (its own seed), so every run learns the same function; `seed` only
        # changes which inputs are drawn. Everything is generated on the device: no host round trips.
        return self._labelled(device, seed)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Inputs of the held-out seed, labelled by the same teacher: the same batches for every run."""
        return self._labelled(device, EVAL_SEED)

    def eval_metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = batch
        return classification_sums(model(x), y)

    def _labelled(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        teacher_gen = torch.Generator(device=device).manual_seed(1234)
        teacher = torch.randn(self.in_features, self.num_classes, generator=teacher_gen, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        while True:
            x = torch.randn(self.batch_size, self.in_features, generator=gen, device=device)
            # Labels in fp32 even when the caller draws a batch inside autocast (as the torch.amp examples
            # do): the data must not depend on the precision mode under test.
            with torch.autocast(device.type, enabled=False):
                y = (x @ teacher).argmax(dim=-1)
            yield x, y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)
