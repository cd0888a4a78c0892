"""Recipes whose evaluation would change training if ampctl let it: one that draws from the global RNG while it
evaluates (a user's randomized evaluation), on the GPT with dropout, whose training draws from the same RNG."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ampctl.recipes.gpt import GPTRecipe


@dataclass
class RandomEvalGPT(GPTRecipe):
    def eval_metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        torch.rand(1000)  # the global RNG moves: dropout's next masks would differ
        return super().eval_metrics(model, batch)
