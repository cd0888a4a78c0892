"""The policy and the training state from a validated config: what train, inspect, memory, diagnose and the
benchmarks share. Refusals come first (check_config), before anything is built."""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from ampctl.conf.precision_schema import scaler_is_active
from ampctl.conf.schema import validate
from ampctl.engine import devices
from ampctl.engine import parallel as parallelism
from ampctl.engine.activation_checkpointing import apply_activation_checkpointing
from ampctl.engine.compilation import compile_model
from ampctl.engine.loop import TrainState
from ampctl.engine.optim import (
    LRSchedule,
    build_optimizer,
    check_optimizer_arguments,
    check_optimizer_with_scaler,
    prime_fused_sgd_momentum,
)
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.scaler import build_scaler
from ampctl.recipes.base import Recipe, building_model, checked_model


def check_config(cfg: DictConfig) -> PrecisionPolicy:
    """Everything that can be refused before building anything: ranges, then what the device can do."""
    validate(cfg)
    parallelism.check(cfg)
    device = parallelism.local_device(devices.resolve_device(cfg.device.value), cfg.distributed.kind)
    policy = PrecisionPolicy(OmegaConf.to_object(cfg.precision), device)
    policy.check()
    check_optimizer_with_scaler(cfg.optimizer, scaler_is_active(cfg.scaler))
    check_optimizer_arguments(cfg.optimizer)
    return policy



def build_state(cfg: DictConfig, policy: PrecisionPolicy, recipe: Recipe,
                parallel: Optional[parallelism.Parallel] = None) -> TrainState:
    """Seed, build the model the policy's way (wrapped for data parallelism: DDP, or sharded by FSDP before
    the optimizer sees its parameters), then its optimizer, loss scaler and lr schedule."""
    parallel = parallel or parallelism.Parallel()
    torch.manual_seed(cfg.train.seed)
    with building_model(recipe):
        model = recipe.build_model()
    model = policy.prepare_model(checked_model(model, recipe))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, recipe, cfg.recipe._target_.rsplit(".", 1)[-1])
    blocks = list(getattr(recipe, "activation_checkpoint_blocks", lambda _model: [])(model))
    if cfg.train.compile:  # after the mode's converters and checkpointing, before DDP/FSDP wrap the blocks
        compile_model(model, blocks, cfg.train.compile_mode, profiled=cfg.train.profile is not None)
    parallel.wrap(model, blocks)
    weights = policy.weight_layout(model)
    optimizer = build_optimizer(cfg.optimizer, weights.optimizer_params, policy.device)
    half_grads = any(p.dtype != torch.float32 for p in weights.optimizer_params)
    scaler = build_scaler(cfg.scaler, policy.device, half_grads=half_grads)
    if parallel.shards_gradients:
        scaler.agree_across_ranks()
    if scaler.can_skip:
        prime_fused_sgd_momentum(optimizer)
    schedule = LRSchedule(optimizer, cfg.train, policy.device)
    return TrainState(model, weights, optimizer, scaler, schedule, parallel=parallel)
