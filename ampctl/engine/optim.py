"""The optimizer and its learning-rate schedule.

The schedule is a function of the number of steps the optimizer actually applied, so a step skipped by
the loss scaler does not advance it. With fused optimizers the learning rate is a device tensor and the
schedule is evaluated on the device from a device-side count of applied steps: no host sync per step.
Other optimizers keep a float lr; knowing whether a step was skipped then needs one read of found_inf,
which torch's GradScaler has already paid for (it syncs in step() for non-fused optimizers).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
from typing import Any, Callable, Iterable

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from ampctl.conf.messages import instantiation_error
from ampctl.conf.train_schema import Schedule
from ampctl.engine import optimizer_states
from ampctl.errors import UnsupportedError, UsageError


def build_optimizer(cfg: DictConfig, params: Iterable[torch.nn.Parameter],
                    device: torch.device) -> torch.optim.Optimizer:
    """Instantiate the `_partial_` optimizer config over params. Fused optimizers get a device tensor lr."""
    target = cfg.get("_target_")
    if str(target).startswith("bitsandbytes."):
        # its CPU backend warns at import about 4-bit matmul kernels, which an 8-bit optimizer never uses
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        # plain lists and dicts: an optimizer keeps what it is given in its param_groups (betas), which its
        # state dict then holds, and torch.distributed's gathering of it takes no ListConfig (torchao's AdamW)
        factory: Callable[..., torch.optim.Optimizer] = instantiate(cfg, _convert_="all")
    except InstantiationException as exc:
        hint = ""
        if str(target).startswith("bitsandbytes.") and importlib.util.find_spec("bitsandbytes") is None:
            hint = "; bitsandbytes is not installed: pip install 'ampctl[adam8bit]'"
        if optimizer_states.is_torchao(cfg) and importlib.util.find_spec("torchao") is None:
            hint = f"; torchao is not installed: {optimizer_states.INSTALL_HINT}"
        raise UsageError(f"optimizer._target_={target!r} could not be instantiated: "
                         f"{instantiation_error(exc)}{hint}") from None
    if not callable(factory):
        raise UsageError(f"optimizer._target_={target!r} must be a callable taking params (set _partial_: true)")
    params = list(params)
    kwargs: dict[str, Any] = {}
    if cfg.get("fused") or cfg.get("capturable"):
        kwargs["lr"] = torch.tensor(float(cfg.lr), device=device, dtype=lr_tensor_dtype(device))
    elif optimizer_states.is_torchao(cfg):
        # torchao's take their lr as a float32 tensor (a float becomes one on the CPU, which the schedule's
        # device-side update would copy from a GPU every step): on the device, as a fused optimizer's
        kwargs["lr"] = torch.tensor(float(cfg.lr), device=device, dtype=torch.float32)
    try:
        return factory(params, **kwargs)
    except (ValueError, TypeError) as exc:  # torch's check of an argument ("Invalid momentum value: -1"), a
        # key it does not take (+optimizer.foo=1), a _target_ that is no optimizer: not about fused
        raise UsageError(f"optimizer ({target}) refused its arguments: {str(exc).splitlines()[0]}"
                         + ("; optimizer._target_ must name a torch.optim.Optimizer (or a callable taking params "
                            "and returning one)" if isinstance(exc, TypeError) else "")) from None
    except RuntimeError as exc:
        if cfg.get("fused"):
            raise UnsupportedError(
                f"optimizer.fused=true: torch {torch.__version__} has no fused {target} for these "
                f"{device.type} parameters ({str(exc).splitlines()[0]}); set optimizer.fused=false"
            ) from None
        raise UsageError(f"optimizer {target}: {str(exc).splitlines()[0]}") from None


def prime_fused_sgd_momentum(optimizer: torch.optim.Optimizer) -> None:
    """torch's fused SGD allocates its momentum buffers with empty_like on its first step and marks them
    initialised even when the loss scaler skips that step: the next step reads uninitialised memory (NaN
    weights). Zero buffers, put in place before the first step, avoid that and change nothing else: with
    dampening 0 the kernel's later-step rule, buf = momentum * 0 + grad, is exactly its first-step rule,
    buf = grad; a skipped first step leaves them zero, as an unfused SGD leaves its buffers unset."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group.get("fused") and group["momentum"] != 0:
            for p in group["params"]:
                buffer = torch.zeros_like(p, memory_format=torch.preserve_format)
                optimizer.state[p].setdefault("momentum_buffer", buffer)


def check_optimizer_with_scaler(optimizer_cfg: DictConfig, scaler_can_skip: bool) -> None:
    """Refuse what prime_fused_sgd_momentum cannot make right: with dampening, torch's first-step rule
    (buf = grad) differs from its later-step rule on a zero buffer."""
    if (scaler_can_skip and str(optimizer_cfg.get("_target_")) == "torch.optim.SGD" and optimizer_cfg.get("fused")
            and optimizer_cfg.get("momentum", 0) and optimizer_cfg.get("dampening", 0)):
        raise UsageError(
            f"optimizer.dampening={optimizer_cfg.dampening} with optimizer.fused=true under a loss scaler: torch's "
            "fused SGD leaves its momentum uninitialised when the scaler skips its first step; set "
            "optimizer.fused=false (or dampening=0)")


def check_optimizer_arguments(optimizer_cfg: DictConfig) -> None:
    """Before anything is built (and before compare or a sweep starts a process): the optimizer's _target_
    takes the parameters first and every key the config gives it, by its signature. A _target_ whose
    signature cannot be read (a C extension) is left to its construction."""
    target = str(optimizer_cfg.get("_target_"))
    try:
        factory = get_object(target)
        parameters = inspect.signature(factory).parameters
    except Exception:  # noqa: BLE001 - unimportable: its instantiation names why
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    if not parameters:
        raise UsageError(f"optimizer._target_={target!r} takes no arguments: it must name a torch.optim.Optimizer "
                         "(or a callable taking the parameters and returning one)")
    names = [name for name in parameters if name != next(iter(parameters))]  # the first takes the params
    unknown = [key for key in optimizer_cfg if not str(key).startswith("_") and key not in names]
    if unknown:
        raise UsageError(f"optimizer.{unknown[0]}: {target} takes no argument {unknown[0]!r}; it takes "
                         f"{', '.join(names)}")


def lr_tensor_dtype(device: torch.device) -> torch.dtype:
    """CUDA's fused kernels read a float32 lr tensor. The CPU kernels read it as a double, so float64
    there keeps the step bit-identical to a plain float lr (the canonical torch.amp loop)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def lr_factor(applied: torch.Tensor, kind: Schedule, warmup: int, total: int, min_ratio: float) -> torch.Tensor:
    """Multiplier of the base lr after `applied` optimizer steps (a float tensor; works on any device)."""
    factor = torch.ones_like(applied)
    if warmup > 0:
        factor = torch.clamp((applied + 1) / warmup, max=1.0)
    progress = torch.clamp((applied - warmup) / max(1, total - warmup), 0.0, 1.0)
    if kind is Schedule.cosine:
        factor = factor * (min_ratio + (1 - min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress)))
    elif kind is Schedule.linear:
        factor = factor * (1 - (1 - min_ratio) * progress)
    return factor


def as_written(lr: Any) -> float:
    """An optimizer's lr as the config wrote it: one kept as a float32 tensor (torchao's optimizers, CUDA's fused
    kernels) holds 0.001 as 0.0010000000474974513, and the shortest decimal that float32 reads back as that value is
    the one written (numpy's shortest round-trip repr). A float, or a float64 tensor, is itself."""
    if isinstance(lr, torch.Tensor) and lr.dtype == torch.float32:
        return float(np.format_float_positional(np.float32(lr.item()), unique=True, trim="0"))
    return float(lr)


class LRSchedule:
    """Sets the optimizer's lr for the next step from the count of applied (not skipped) steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: DictConfig, steps: int, device: torch.device) -> None:
        """lr: train.lr (its schedule, warm-up and floor); steps: train.steps, over which it decays."""
        self.optimizer = optimizer
        self.kind: Schedule = lr.schedule
        self.warmup, self.total, self.min_ratio = lr.warmup_steps, steps, lr.min_ratio
        first_lr = optimizer.param_groups[0]["lr"]
        self.on_device = isinstance(first_lr, torch.Tensor)
        self.base_lrs = [as_written(g["lr"]) for g in optimizer.param_groups]  # one read, before training
        count_device = device if self.on_device else torch.device("cpu")
        # float64, so factor * base loses nothing against the lr the user wrote (the optimizer's own lr tensor may be
        # float32: torchao's, CUDA's fused kernels), whatever the dtype the optimizer keeps it in
        self.applied = torch.zeros((), device=count_device, dtype=torch.float64)
        # applied steps known on the host and not yet added to self.applied: every step, when no step can be
        # skipped (no kernel a step for a count nobody reads until the lr changes or a checkpoint is written)
        self._counted_on_host = 0
        # The schedule's lr of the coming step, float64 on the device, for telemetry: the value the schedule gives
        # (a float32 copy, as torchao's optimizers keep theirs, recorded 5e-05 as 4.999999873689376e-05)
        self._lr_now = torch.zeros((), device=count_device, dtype=torch.float64)
        self._apply()

    def _applied(self) -> torch.Tensor:
        if self._counted_on_host:
            self.applied += self._counted_on_host
            self._counted_on_host = 0
        return self.applied

    def _apply(self) -> None:
        factor = lr_factor(self._applied(), self.kind, self.warmup, self.total, self.min_ratio)
        for i, (group, base) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            if self.on_device:
                lr = factor * base
                group["lr"].copy_(lr)  # in the optimizer's own dtype
                if i == 0:
                    self._lr_now = lr  # the schedule's own float64 value: no kernel of its own
            else:
                group["lr"] = float(factor) * base
                if i == 0:
                    self._lr_now.fill_(group["lr"])

    def current_lr(self) -> torch.Tensor:
        return self._lr_now

    def step(self, found_inf: torch.Tensor, can_skip: bool) -> None:
        if can_skip and self.on_device:
            self.applied += 1 - found_inf  # on the device: no sync
        elif not can_skip or not bool(found_inf):  # bool() reads the device: see module docstring
            self._counted_on_host += 1
        if self.kind is not Schedule.constant or self.warmup > 0:
            self._apply()  # a constant lr without warm-up never changes: nothing to recompute

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self._applied().item(), "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied.fill_(state["applied"])
        self._counted_on_host = 0
        self.base_lrs = list(state["base_lrs"])
        self._apply()
