"""A recipe built to break in one known layer (`ampctl diff`'s test): `cancel`, a Linear whose every output is the
difference of two nearly equal terms. Its input holds each feature twice, exactly (the forward duplicates them),
and row i weighs the pair (2i, 2i+1) by +1 and -(1 + 2^-13): the output is -2^-13 h_i. 2^-13 is below half a unit
in the last place of 1 in fp16 (2^-11), bf16 (2^-8) and every FP8 and MX format, so there the two weights round
to the same magnitude and the output is lost (0: a relative error of 1); fp32 (2^-24) keeps it. The layers
before and after it (`inp`, `out`) are ordinary Linear layers: they add a half type's usual rounding and no
more, whatever they inherit."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

EPS = 2.0 ** -13


class FragileModel(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cancel = nn.Linear(2 * width, width, bias=False)
        self.out = nn.Linear(width, classes)
        weight = torch.zeros(width, 2 * width)
        rows = torch.arange(width)
        weight[rows, 2 * rows], weight[rows, 2 * rows + 1] = 1.0, -(1.0 + EPS)
        with torch.no_grad():
            self.cancel.weight.copy_(weight)
        # fixed, so that training cannot move the model off the path that cancels (a half type never learns it)
        self.cancel.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        pairs = torch.stack([h, h], dim=-1).flatten(-2)  # each feature twice, side by side
        return self.out(self.cancel(pairs) / EPS)  # back to h's size: fp32's output is -h


class FragileRecipe:
    """recipe=mlp recipe._target_=tests.support.fragile_layer_recipe.FragileRecipe (the MLP's keys ignored)."""

    def __init__(self, width: int = 32, classes: int = 16, batch_size: int = 64, **_mlp_keys: object) -> None:
        self.width, self.classes, self.batch_size = width, classes, batch_size
        self.samples_per_batch, self.tokens_per_batch = batch_size, None

    def build_model(self) -> nn.Module:
        return FragileModel(self.width, self.classes)

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # labelled by a fixed teacher, so that a model learns them only through `cancel`'s output
        teacher = torch.randn(self.width, self.classes, generator=torch.Generator(device=device).manual_seed(7),
                              device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        while True:
            x = torch.randn(self.batch_size, self.width, generator=gen, device=device)
            with torch.autocast(device.type, enabled=False):
                yield x, (x @ teacher).argmax(dim=-1)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Held-out batches (a seed of their own): diff.prove's comparison judges the modes by them."""
        return self.batches(device, 10_000)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)
