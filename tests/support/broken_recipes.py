"""User recipes that break the recipe protocol, one way each (`mistake=`): each must end in one line naming
the recipe member and what the protocol needs."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn


class BrokenRecipe:
    def __init__(self, mistake: str, batch_size: int = 8, **_ignored: Any) -> None:
        if mistake == "raises_in_init":
            raise ValueError("vocab file 'data/vocab.txt' not found")
        self.mistake = mistake
        self.samples_per_batch, self.tokens_per_batch = batch_size, None
        if mistake == "string_samples":  # read from a config file as text
            self.samples_per_batch = str(batch_size)
        if mistake == "zero_samples":
            self.samples_per_batch = 0
        if mistake == "int_blocks":
            self.activation_checkpoint_blocks = lambda model: 5

    def build_model(self) -> Any:
        if self.mistake == "slow_build":  # not a mistake: a build long enough to press Ctrl-C during it
            time.sleep(60)
        if self.mistake == "swallows_a_signal":  # a library that catches the KeyboardInterrupt (an optional import)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except BaseException:  # noqa: BLE001 - what the library does
                pass
        if self.mistake == "not_a_module":
            return [nn.Linear(4, 1)]
        return nn.Linear(4, 1)

    def batches(self, device: torch.device, seed: int) -> Any:
        if self.mistake == "int_batches":
            return 42
        return self._batches(device, seed)

    def _batches(self, device: torch.device, seed: int) -> Iterator[Any]:
        gen = torch.Generator(device=device).manual_seed(seed)
        count = 3 if self.mistake == "finite_batches" else None
        while count is None or count > 0:
            count = None if count is None else count - 1
            x = torch.randn(self.samples_per_batch, 4, generator=gen, device=device)
            y = x.sum(1, keepdim=True)
            yield [x.tolist(), y.tolist()] if self.mistake == "list_batches" else (x, y)

    def loss(self, model: nn.Module, batch: Any) -> Any:
        x, y = batch
        out = model(x)
        if self.mistake == "half_overflow":  # a constant the half type cannot hold, made in the autocast's dtype
            out = out + torch.full_like(out, 1e5) * 0
        if self.mistake == "nondeterministic_op":  # put_ has no deterministic implementation (train.deterministic)
            out = out + torch.zeros(out.numel(), device=out.device).put_(
                torch.tensor([0], device=out.device), torch.ones(1, device=out.device)).view_as(out) * 0
        if self.mistake == "mixed_dtypes":  # a matmul of autocast's half output with an fp32 tensor, outside autocast
            with torch.autocast(out.device.type, enabled=False):
                out = out @ torch.ones(1, 1, device=out.device)
        if self.mistake == "vector_loss":
            return F.mse_loss(out, y, reduction="none")
        if self.mistake == "integer_loss":
            return 3
        if self.mistake == "none_loss":
            return None
        if self.mistake == "detached_loss":
            return F.mse_loss(out, y).detach()
        if self.mistake == "nan_loss":  # data with a NaN in every batch
            return F.mse_loss(out, y) * float("nan")
        if self.mistake == "item_in_loss":  # not a mistake: a loss that reads a value back (no trace on meta)
            return F.mse_loss(out, y) * (1.0 + 0.0 * float(y.abs().max().item()))
        return F.mse_loss(out, y)
