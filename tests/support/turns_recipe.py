"""The mlp recipe, telling when each of its steps ran (for compare's turns): every loss call appends
`pid step time` to `step_log`, time on the system-wide monotonic clock that all processes share; with
`fail_half_at`, a run whose model computes in a half type fails at that step (one mode fails, the others go on)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ampctl.recipes.mlp import MLPRecipe


@dataclass
class TurnsRecipe(MLPRecipe):
    step_log: str = ""
    fail_half_at: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._calls = 0

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if next(model.parameters()).device.type == "meta":  # the FLOP count at start, not a step
            return super().loss(model, batch)
        self._calls += 1
        started = time.monotonic()
        loss = super().loss(model, batch)
        if self.fail_half_at is not None and self._calls >= self.fail_half_at:
            if model(batch[0]).dtype != torch.float32:
                raise RuntimeError(f"half precision failed at step {self._calls}, as this test asked")
        with open(self.step_log, "a") as log:
            log.write(f"{os.getpid()} {self._calls} {started} {time.monotonic()}\n")
        return loss
