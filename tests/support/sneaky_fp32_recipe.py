"""The MLP recipe whose last layer is a Linear that turns autocast off in its own forward (as a user's module may):
precision=bf16's plan says the layer computes in bfloat16, and its matmuls run in float32 (train.profile's matmul
line must name it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.recipes.mlp import MLPRecipe


class SneakyFP32Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight, self.bias)


@dataclass
class SneakyFP32Recipe(MLPRecipe):
    def build_model(self) -> nn.Module:
        model = super().build_model()
        last = model[-1]
        sneaky = SneakyFP32Linear(last.in_features, last.out_features)
        sneaky.load_state_dict(last.state_dict())
        model[-1] = sneaky
        return model
