"""A recipe whose batch size changes every step (a data pipeline that does not drop its ragged batches): under
torch.compile, the steps after the first recompile. Not a mistake: a run that is slow for a reason ampctl
must name."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ampctl.recipes.mlp import MLPRecipe


class ShapeChangingRecipe(MLPRecipe):
    def batches(self, device: torch.device, seed: int) -> Iterator[Any]:
        for step, (x, y) in enumerate(super().batches(device, seed)):
            keep = self.samples_per_batch - step % 7  # 7 sizes in turn
            yield x[:keep], y[:keep]
