"""Activation checkpointing: the blocks a recipe names keep only their inputs in the forward pass and
recompute their activations in the backward pass (torch.utils.checkpoint, non-reentrant). The recompute runs
under the autocast state of the original forward (torch saves and restores it), so it composes with every
precision mode. It trades about one extra forward per block for the activations' memory."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.utils.checkpoint
from torch import nn

from ampctl.errors import UsageError
from ampctl.recipes.base import checked_blocks


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def require_checkpoint_blocks(recipe: Any, recipe_name: str) -> None:
    if getattr(recipe, "activation_checkpoint_blocks", None) is None:
        raise UsageError(
            f"train.activation_checkpointing=true: recipe {recipe_name} names no blocks to checkpoint "
            "(a recipe offers activation_checkpoint_blocks(model); gpt, resnet, timm and hf_causal_lm do)"
        )


def apply_activation_checkpointing(model: nn.Module, recipe: Any, recipe_name: str) -> int:
    """Checkpoint every block the recipe's activation_checkpoint_blocks(model) returns; the number wrapped."""
    require_checkpoint_blocks(recipe, recipe_name)
    blocks = checked_blocks(recipe.activation_checkpoint_blocks(model), recipe)
    if not blocks:  # a model whose structure the recipe could not read (a timm model without block groups)
        raise UsageError(f"train.activation_checkpointing=true: recipe {recipe_name} found no blocks to checkpoint "
                         "in this model; run without it")
    for block in blocks:
        # An instance attribute shadows the class's forward; parameters and state_dict stay as they were.
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(blocks)


def original_forward(block: nn.Module) -> Callable[..., Any]:
    """The block's forward without checkpointing (to measure what one recomputation holds)."""
    forward = block.forward
    if isinstance(forward, functools.partial) and forward.func is _checkpointed:
        return forward.args[0]
    return forward
