"""The mlp recipe with an input pipeline that cannot keep up: each batch takes `data_delay_s` of host time."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ampctl.recipes.mlp import MLPRecipe


@dataclass
class SlowDataRecipe(MLPRecipe):
    data_delay_s: float = 0.03

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in super().batches(device, seed):
            time.sleep(self.data_delay_s)  # a DataLoader whose workers are behind
            yield batch


@dataclass
class StallingRecipe(MLPRecipe):
    """The mlp recipe whose input pipeline stalls once: the batch of step `stall_at` takes `stall_s`."""

    stall_at: int = 10
    stall_s: float = 3.0

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index, batch in enumerate(super().batches(device, seed), start=1):
            if index == self.stall_at:
                time.sleep(self.stall_s)  # a data worker that stopped answering, for a while
            yield batch


@dataclass
class BusyDataRecipe(MLPRecipe):
    """The mlp recipe that makes each batch in the loop's thread with `data_work_s` of CPU work (a synthetic batch
    generated on the CPU, a tokenizer in the loop): the batch's own cost, not a wait on a pipeline."""

    data_work_s: float = 0.03

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in super().batches(device, seed):
            end = time.thread_time() + self.data_work_s
            while time.thread_time() < end:  # the thread's own work: CPU time, as making a batch takes
                pass
            yield batch


@dataclass
class SlowStepRecipe(MLPRecipe):
    """The mlp recipe whose every step takes `step_s` more (a model that is slow here), and `in_turns_s` more again
    in a comparison's rounds (compare's runs in turns: a machine that got busy after advise's calibration)."""

    step_s: float = 0.1
    in_turns_s: float = 0.0

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if next(model.parameters()).device.type != "meta":  # not the FLOP count at start
            from ampctl.runner.round_windows import ROUND_ENDS_ENV

            time.sleep(self.step_s + (self.in_turns_s if os.environ.get(ROUND_ENDS_ENV) else 0.0))
        return super().loss(model, batch)


@dataclass
class SelfInterruptingRecipe(MLPRecipe):
    """The mlp recipe whose process gets SIGINT as it makes the batch of step `signal_at` (a Ctrl-C mid-run, at a
    known step)."""

    signal_at: int = 3

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index, batch in enumerate(super().batches(device, seed), start=1):
            if index == self.signal_at:
                os.kill(os.getpid(), signal.SIGINT)
            yield batch
