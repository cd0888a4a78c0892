"""The training state from a checked config and its policy (runner/plan.py's check_config): what train, inspect,
memory, diagnose and the benchmarks share."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from omegaconf import DictConfig

from ampctl.engine import parallel as parallelism
from ampctl.engine.activation_checkpointing import apply_activation_checkpointing
from ampctl.engine.compilation import compile_model
from ampctl.engine.loop import TrainState
from ampctl.engine.optim import (
    LRSchedule,
    build_optimizer,
    prime_fused_sgd_momentum,
)
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.scaler import build_scaler
from ampctl.engine.weight_average import WeightAverage
from ampctl.recipes.base import Recipe, building_model, checked_model


def seed_everything(seed: int) -> None:
    """torch's generators (every device's), Python's and NumPy's: a recipe that draws from any of them starts the
    same way each run (a resumed run then restores each from its checkpoint)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def build_state(cfg: DictConfig, policy: PrecisionPolicy, recipe: Recipe,
                parallel: Optional[parallelism.Parallel] = None) -> TrainState:
    """Seed, build the model the policy's way (wrapped for data parallelism: DDP, or sharded by FSDP before
    the optimizer sees its parameters), then its optimizer, loss scaler and lr schedule."""
    parallel = parallel or parallelism.Parallel()
    seed_everything(cfg.train.seed)
    with building_model(recipe):
        model = recipe.build_model()
    if policy.converter is not None and parallel.shards_gradients:
        policy.converter.shard_with_fsdp(model)  # FSDP2: a converter may all-gather its layers in its format
    model = policy.convert_module(checked_model(model, recipe))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, recipe, cfg.recipe._target_.rsplit(".", 1)[-1])
    blocks = list(getattr(recipe, "activation_checkpoint_blocks", lambda _model: [])(model))
    if cfg.train.compile.enabled:  # after the mode's converters and checkpointing, before DDP/FSDP wrap the blocks
        compile_model(model, blocks, cfg.train.compile.mode, profiled=cfg.train.profile is not None)
    parallel.wrap(model, blocks)
    weights = policy.weight_layout(model, cfg.train.grad_accum_steps)
    optimizer = build_optimizer(cfg.optimizer, weights.optimizer_params, policy.device)
    half_grads = any(p.dtype != torch.float32 for p in weights.optimizer_params)
    scaler = build_scaler(cfg.scaler, policy.device, half_grads=half_grads)
    if parallel.shards_gradients:
        scaler.agree_across_ranks()
    if scaler.can_skip:
        prime_fused_sgd_momentum(optimizer)
    schedule = LRSchedule(optimizer, cfg.train.lr, cfg.train.steps, policy.device)
    train = cfg.train
    ema = (WeightAverage(model, weights.optimizer_params, train.ema.decay, train.ema.start_step, train.ema.every)
           if train.ema.decay is not None else None)
    return TrainState(model, weights, optimizer, scaler, schedule, parallel=parallel, ema=ema)
