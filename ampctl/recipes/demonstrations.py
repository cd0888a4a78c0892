"""Recipes built to fail in one known way, so that what ampctl does about a failure can be seen on any machine in
seconds: the guards' diagnosis and escalation (docs/runs.md), diff's ranking and repair (docs/analysis.md). Each fails
by construction, not by chance; each docstring says how.

- exploding: a layer that overflows float16 from a chosen step on;
- fragile: a layer whose every output cancels below the resolution of any half or 8-bit type;
- loss_spike: the MLP with one batch scaled up, a loss spike that is the data's (fp32 spikes too);
- rounding_spike: one batch shifted so far that a half type's first matmul rounds its inputs away, a spike that is
  precision's (fp32 does not spike)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.recipes.base import require_positive
from ampctl.recipes.mlp import MLPRecipe

Batch = tuple[torch.Tensor, torch.Tensor]


def _teacher_labels(x: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):  # the labels are fp32's, whatever the mode
        return (x @ teacher).argmax(dim=-1)


def _teacher(width: int, classes: int, device: torch.device) -> torch.Tensor:
    """A fixed random teacher (a seed of its own): every run learns the same function."""
    return torch.randn(width, classes, generator=torch.Generator(device=device).manual_seed(7), device=device)


class Amplify(nn.Module):
    """Its input times a constant: a layer with no weights whose output leaves float16's range when its input grows."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor:g}"


@dataclass
class ExplodingRecipe:
    """inp (Linear 16->32), act, amplifier (x factor), out (Linear 32->4). From step `input_gain_from_step` on, the
    inputs are `input_gain` times larger: amplifier's output (~1e5 with the defaults) is beyond float16's 65504, every
    fp16 step overflows and is skipped, and the guards trip; in fp32 or bf16 it trains on (badly: its loss is
    large)."""

    factor: float = 1e3
    input_gain_from_step: int = 5
    input_gain: float = 100.0
    batch_size: int = 32

    def __post_init__(self) -> None:
        require_positive(self, "batch_size")
        self.samples_per_batch, self.tokens_per_batch = self.batch_size, None

    def build_model(self) -> nn.Module:
        return nn.Sequential(OrderedDict(
            inp=nn.Linear(16, 32), act=nn.ReLU(), amplifier=Amplify(self.factor), out=nn.Linear(32, 4)))

    def batches(self, device: torch.device, seed: int) -> Iterator[Batch]:
        gen = torch.Generator(device=device).manual_seed(seed)
        step = 0
        while True:
            step += 1
            x = torch.randn(self.samples_per_batch, 16, generator=gen, device=device)
            y = torch.randint(4, (self.samples_per_batch,), generator=gen, device=device)
            yield (x * self.input_gain if step >= self.input_gain_from_step else x), y

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)


CANCEL_EPS = 2.0 ** -13  # below half a unit in the last place of 1 in fp16 (2^-11), bf16 (2^-8) and every 8-bit type


class FragileModel(nn.Module):
    """inp, cancel, out. `cancel` is a Linear whose every output is the difference of two nearly equal terms: its
    input holds each feature twice, exactly (the forward duplicates them), and row i weighs the pair (2i, 2i+1) by +1
    and -(1 + 2^-13), so its output is -2^-13 h_i. In fp16, bf16 and every FP8 and MX format the two weights round
    to the same magnitude and the output is lost (0: a relative error of 1); fp32 (2^-24) keeps it. `inp` and `out`
    are ordinary Linear layers: they add a half type's usual rounding and no more."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.cancel = nn.Linear(2 * width, width, bias=False)
        self.out = nn.Linear(width, classes)
        weight = torch.zeros(width, 2 * width)
        rows = torch.arange(width)
        weight[rows, 2 * rows], weight[rows, 2 * rows + 1] = 1.0, -(1.0 + CANCEL_EPS)
        with torch.no_grad():
            self.cancel.weight.copy_(weight)
        # fixed, so that training cannot move the model off the path that cancels (a half type never learns it)
        self.cancel.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        pairs = torch.stack([h, h], dim=-1).flatten(-2)  # each feature twice, side by side
        return self.out(self.cancel(pairs) / CANCEL_EPS)  # back to h's size: fp32's output is -h


@dataclass
class FragileRecipe:
    """A classifier that learns only through `cancel` (FragileModel): `ampctl diff` ranks `cancel` first in every
    half and 8-bit mode, and its repair raises it."""

    width: int = 32
    classes: int = 16
    batch_size: int = 64

    def __post_init__(self) -> None:
        require_positive(self, "width", "classes", "batch_size")
        self.samples_per_batch, self.tokens_per_batch = self.batch_size, None

    def build_model(self) -> nn.Module:
        return FragileModel(self.width, self.classes)

    def batches(self, device: torch.device, seed: int) -> Iterator[Batch]:
        teacher = _teacher(self.width, self.classes, device)
        gen = torch.Generator(device=device).manual_seed(seed)
        while True:
            x = torch.randn(self.batch_size, self.width, generator=gen, device=device)
            yield x, _teacher_labels(x, teacher)

    def eval_batches(self, device: torch.device) -> Iterator[Batch]:
        """Held-out batches (a seed of their own): diff.prove's comparison judges the modes by them."""
        return self.batches(device, 10_000)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)


@dataclass
class LossSpikeRecipe(MLPRecipe):
    """The MLP with the inputs of step `spike_at`'s batch multiplied by `gain`: its logits, and its loss, jump many
    times above the steps before, in fp32 as in any mode: a spike that is the data's, not precision's."""

    spike_at: int = 60  # the step (1-based) whose batch spikes; 0: none
    gain: float = 30.0

    def batches(self, device: torch.device, seed: int) -> Iterator[Batch]:
        for step, (x, y) in enumerate(super().batches(device, seed), start=1):
            yield (x * self.gain if step == self.spike_at else x), y


class Center(nn.Linear):
    """x - mean(x) over the features, through a frozen identity Linear (a matmul, which autocast runs in its half
    type)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.eye(width))
        self.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        return h - h.mean(dim=-1, keepdim=True)


@dataclass
class RoundingSpikeRecipe:
    """center (Center), inp, act, out; the batch of step `spike_at` comes with every feature shifted by `offset`. In
    fp32 the shift cancels to within 2^-24 of 512 and the model sees the inputs it always sees; in a half type the
    identity matmul rounds 512 + x to the type's step at 512 (bf16: 4, fp16: 0.5), so the centred inputs are mostly
    rounding and the loss spikes: a spike that is precision's, which raising `center` to fp32 removes."""

    width: int = 16
    classes: int = 4
    batch_size: int = 64
    spike_at: int = 60  # the step (1-based) whose batch is shifted
    offset: float = 512.0

    def __post_init__(self) -> None:
        require_positive(self, "width", "classes", "batch_size")
        self.samples_per_batch, self.tokens_per_batch = self.batch_size, None

    def build_model(self) -> nn.Module:
        return nn.Sequential(OrderedDict(center=Center(self.width), inp=nn.Linear(self.width, 64), act=nn.ReLU(),
                                         out=nn.Linear(64, self.classes)))

    def batches(self, device: torch.device, seed: int) -> Iterator[Batch]:
        teacher = _teacher(self.width, self.classes, device)
        gen = torch.Generator(device=device).manual_seed(seed)
        step = 0
        while True:
            step += 1
            x = torch.randn(self.batch_size, self.width, generator=gen, device=device)
            y = ((x - x.mean(dim=-1, keepdim=True)) @ teacher).argmax(dim=-1)
            yield (x + self.offset if step == self.spike_at else x), y

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)
