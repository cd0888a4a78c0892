"""The MLP recipe with one batch made to spike the loss (`guard.loss_spike`'s test): the inputs of the batch of step
`spike_at` are multiplied by `gain`, so that its logits, and its cross-entropy loss, jump many times above the
losses of the steps before; every other batch is the MLP's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ampctl.recipes.mlp import MLPRecipe


@dataclass
class SpikeRecipe(MLPRecipe):
    spike_at: int = 60  # the step (1-based) whose batch spikes; 0: none
    gain: float = 30.0

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step, (x, y) in enumerate(super().batches(device, seed), start=1):
            yield (x * self.gain if step == self.spike_at else x), y
