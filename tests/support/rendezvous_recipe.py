"""The mlp recipe whose model build waits for `parties` processes to reach it (files in `rendezvous_dir`): runs started
together are held together past their checks (the plan's, before the build) to what comes after the build."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ampctl.recipes.mlp import MLPRecipe


@dataclass
class RendezvousRecipe(MLPRecipe):
    rendezvous_dir: str = ""
    parties: int = 2
    timeout_s: float = 120.0

    def build_model(self) -> nn.Module:
        here = Path(self.rendezvous_dir)
        (here / str(os.getpid())).touch()
        deadline = time.monotonic() + self.timeout_s
        while len(list(here.iterdir())) < self.parties and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().build_model()
