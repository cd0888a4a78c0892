"""A test recipe for data parallelism: the mlp, except that on one rank, at one step, the loss becomes inf
(every rank must skip that step) or the process fails (the job must end, naming the rank; crash_once: only in
torchrun's first attempt, so that a restart gets past it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ampctl.recipes.mlp import MLPRecipe


@dataclass
class RankFaultRecipe(MLPRecipe):
    fault_rank: int = 1
    fault_step: int = 3
    fault: str = "inf"  # inf | crash | crash_once
    _calls: int = 0
    tokens_per_batch: Optional[int] = None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self._calls += 1
        loss = super().loss(model, batch)
        if dist.is_initialized() and dist.get_rank() == self.fault_rank and self._calls == self.fault_step:
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if self.fault == "crash" or (self.fault == "crash_once" and first_attempt):
                raise RuntimeError(f"injected failure on rank {self.fault_rank}")
            if self.fault == "inf":
                return loss * float("inf")
        return loss
