"""The recipe protocol: what a workload gives the loop. Built-ins live in recipes/; a user's recipe is any
importable callable named by `_target_` in a recipe YAML that returns an object with these members."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol, runtime_checkable

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from ampctl.errors import UsageError


@runtime_checkable
class Recipe(Protocol):
    """A model, an endless stream of batches, and a loss.

    The loop calls ``build_model()`` once (after seeding torch), ``batches(device, seed)`` once, then
    ``loss(model, batch)`` per micro-batch under the precision policy's autocast context. Throughput is
    ``samples_per_batch`` (and ``tokens_per_batch`` for language models) per micro-batch; they are plain
    numbers so that counting them never reads from the device.
    """

    samples_per_batch: int
    tokens_per_batch: Optional[int]

    def build_model(self) -> nn.Module: ...

    def batches(self, device: torch.device, seed: int) -> Iterator[Any]: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...


def build_recipe(cfg: DictConfig) -> Recipe:
    """Instantiate the recipe named by cfg._target_ and check it follows the protocol."""
    target = cfg.get("_target_")
    try:
        recipe = instantiate(cfg)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, UsageError):
            raise cause from None
        first_line = str(exc).strip().splitlines()[0].split(", set env var HYDRA_FULL_ERROR")[0]
        raise UsageError(f"recipe._target_={target!r} could not be instantiated: {first_line}") from None
    missing = [name for name in ("samples_per_batch", "tokens_per_batch", "build_model", "batches", "loss")
               if not hasattr(recipe, name)]
    if missing:
        raise UsageError(
            f"recipe._target_={target!r} returned a {type(recipe).__name__} without {', '.join(missing)}; "
            "a recipe needs samples_per_batch, tokens_per_batch, build_model(), batches(device, seed) "
            "and loss(model, batch) (see README, 'Add your own recipe')"
        )
    return recipe
