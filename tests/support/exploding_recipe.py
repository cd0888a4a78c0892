"""A test recipe whose named layer 'amplifier' blows up from a chosen step on: the replay must find it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Amplify(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class ExplodingRecipe:
    def __init__(self, factor: float = 1e3, input_gain_from_step: int = 5, input_gain: float = 100.0,
                 batch_size: int = 32) -> None:
        self.factor, self.from_step, self.gain = factor, input_gain_from_step, input_gain
        self.samples_per_batch, self.tokens_per_batch = batch_size, None

    def build_model(self) -> nn.Module:
        return nn.Sequential(OrderedDict(
            inp=nn.Linear(16, 32), act=nn.ReLU(), amplifier=Amplify(self.factor), out=nn.Linear(32, 4),
        ))

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator(device=device).manual_seed(seed)
        step = 0
        while True:
            step += 1
            x = torch.randn(self.samples_per_batch, 16, generator=gen, device=device)
            y = torch.randint(4, (self.samples_per_batch,), generator=gen, device=device)
            yield (x * self.gain if step >= self.from_step else x), y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)
