"""A finite loss spike that is precision's (guard.on_trip=escalate's test): the batch of step `spike_at` comes with
every feature shifted by `offset`. The model's first layer, `center`, takes each sample's mean out (a frozen identity
Linear, then the mean subtracted): in fp32 the shift cancels to within 2^-24 of 512, so the model sees the same
inputs as ever; in a half type the identity Linear rounds 512 + x to the type's step at 512 (bf16: 4, fp16: 0.5),
and the centred inputs are mostly rounding. The labels come from a fixed teacher on the centred inputs, so that the
trained model's loss is low and the rounded batch's loss far above it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Center(nn.Linear):
    """x - mean(x) over the features, through an identity Linear (a matmul, which autocast runs in its half type)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.eye(width))
        self.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h - h.mean(dim=-1, keepdim=True)


class OffsetSpikeRecipe:
    def __init__(self, width: int = 16, classes: int = 4, batch_size: int = 64, spike_at: int = 60,
                 offset: float = 512.0) -> None:
        self.width, self.classes, self.batch_size = width, classes, batch_size
        self.spike_at, self.offset = spike_at, offset
        self.samples_per_batch, self.tokens_per_batch = batch_size, None

    def build_model(self) -> nn.Module:
        return nn.Sequential(OrderedDict(center=Center(self.width), inp=nn.Linear(self.width, 64), act=nn.ReLU(),
                                         out=nn.Linear(64, self.classes)))

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        teacher = torch.randn(self.width, self.classes, generator=torch.Generator(device=device).manual_seed(7),
                              device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        step = 0
        while True:
            step += 1
            x = torch.randn(self.batch_size, self.width, generator=gen, device=device)
            y = ((x - x.mean(dim=-1, keepdim=True)) @ teacher).argmax(dim=-1)
            yield (x + self.offset if step == self.spike_at else x), y

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

