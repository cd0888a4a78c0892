"""Loss scalers: one interface, three kinds (none, static, dynamic).

The loop always calls the same verbs, in this order, whatever the kind:
``scale(loss).backward()`` per micro-batch, ``unscale_(opt)`` once, ``step(opt)``, ``found_inf(opt)``,
``update()``. Static and dynamic both run on torch.amp.GradScaler, so unscaling, the inf check and the
fused-optimizer path (found_inf handed to the kernel, no host sync) are torch's own code.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Protocol

import torch
from omegaconf import DictConfig
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from ampctl.errors import UnsupportedError


class LossScaler(Protocol):
    kind: str
    can_skip: bool  # whether this scaler ever skips a step

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def agree_across_ranks(self) -> None:
        """Sharded gradients: make every rank's skip decision the same."""
        ...

    def skip_if_not_finite(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """Between unscale_() and step(): a step whose unscaled gradients have a non-finite norm is skipped,
        like one whose scaled gradients were not finite (on the device)."""
        ...

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """1.0 on the device if this step's gradients were not finite (the step was skipped), else 0.0.
        Valid between step() and update()."""
        ...

    def current_scale(self) -> torch.Tensor:
        """The scale multiplying losses now, as a device tensor (reading it does not sync)."""
        ...

    def update(self) -> None: ...

    def describe(self) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoLossScaler:
    kind = "none"
    can_skip = False

    def __init__(self, device: torch.device) -> None:
        self._one = torch.ones((), device=device)
        self._zero = torch.zeros((), device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def skip_if_not_finite(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        pass  # never skips: a non-finite loss stops the run instead (guard.on_nonfinite)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return self._zero

    def agree_across_ranks(self) -> None:
        pass  # never skips

    def current_scale(self) -> torch.Tensor:
        return self._one

    def update(self) -> None:
        pass

    def describe(self) -> str:
        return "none"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AmpGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler as a LossScaler, plus what torch lacks: optional scale bounds, hysteresis, a static
    mode, and unscaling of fp16 gradients for pure-half training (O3), which torch refuses because it is usually
    a mistake. GradScaler's own verbs (scale, unscale_, step, update, state_dict) are the interface's; the rest
    read its state on the device. The one class that reads GradScaler's private members
    (tests/unit/test_supported_torch.py checks them on the installed torch)."""

    def __init__(
        self,
        device: str | torch.device,
        *,
        kind: str = "dynamic",
        description: str = "",
        static: bool = False,
        allow_fp16_grads: bool = False,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(torch.device(device).type, **kwargs)
        self.kind = kind
        self.can_skip = self.is_enabled()
        self._description = description
        self.hysteresis = hysteresis
        self._hysteresis_left: Optional[torch.Tensor] = None
        self.static = static
        self.allow_fp16_grads = allow_fp16_grads
        self.min_scale = min_scale
        self.max_scale = max_scale
        self._zero = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)

    all_reduce_found_inf = False  # sharded gradients (FSDP): each rank checks only its shard

    def describe(self) -> str:
        return self._description

    def agree_across_ranks(self) -> None:
        self.all_reduce_found_inf = True

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[override]
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self.allow_fp16_grads)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self.all_reduce_found_inf and self._enabled:
            # An inf in any rank's shard skips the step on every rank (as FSDP's ShardedGradScaler does): a
            # collective on the device, no host sync.
            import torch.distributed as dist

            for found_inf in self._found_inf_per_device(optimizer).values():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)

    def skip_if_not_finite(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        # GradScaler checks the gradients before unscaling them. Unscaling can still make them non-finite:
        # half gradients (O3) overflowing as a scale below 1 is divided out, or a norm whose sum of squares
        # overflows. Folding that into found_inf skips the step (fused kernels read found_inf on the device)
        # and backs the scale off, as an overflow would.
        if not self._enabled:
            return
        not_finite = (~torch.isfinite(grad_norm)).float()
        for found_inf in self._found_inf_per_device(optimizer).values():
            torch.maximum(found_inf, not_finite.to(found_inf.device), out=found_inf)

    # step(): GradScaler's. With a fused optimizer it hands found_inf to the kernel (which skips on the device);
    # with any other optimizer torch reads found_inf on the host, one sync per step: prefer fused.

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if not self._enabled:
            return self._zero
        per_device = self._found_inf_per_device(optimizer)
        return torch.stack([t.to(self._zero.device) for t in per_device.values()]).sum().clamp(max=1.0)

    def current_scale(self) -> torch.Tensor:
        if not self._enabled:
            return self._one  # a disabled GradScaler never creates its _scale
        if self._scale is None:  # GradScaler creates its scale at the first scale(): until then it is init_scale
            return torch.full_like(self._one, self._init_scale)
        return self._scale

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        if not self._enabled:
            return
        if self.static and new_scale is None:
            new_scale = self._scale  # a static scaler only forgets this step's found_inf
        if self.hysteresis > 1 and new_scale is None:
            self._update_with_hysteresis()
        else:
            super().update(new_scale)
        if self.min_scale is not None or self.max_scale is not None:
            assert self._scale is not None
            self._scale.clamp_(min=self.min_scale, max=self.max_scale)  # on the device, no sync

    def _update_with_hysteresis(self) -> None:
        """GradScaler's update, except that an overflow backs the scale off only once `hysteresis` overflows have
        come since it last grew (it tolerates hysteresis - 1 of them), DeepSpeed's and Megatron-LM's rule. The
        skipped steps are still skipped. The scale's arithmetic is torch's own kernel's (_amp_update_scale_), fed
        only the overflows that back off: a tolerated one leaves the scale and restarts the growth count. On the
        device."""
        assert self._scale is not None and self._growth_tracker is not None
        found = torch.stack([
            t.to(self._scale.device) for state in self._per_optimizer_states.values()
            for t in state["found_inf_per_device"].values()
        ]).sum().clamp(max=1.0)
        if self._hysteresis_left is None:
            self._hysteresis_left = torch.full((), float(self.hysteresis), device=self._scale.device)
        overflow = found > 0
        self._hysteresis_left.sub_(found)
        back_off = overflow & (self._hysteresis_left <= 0)
        grows = ~overflow & (self._growth_tracker + 1 >= self._growth_interval) & torch.isfinite(
            self._scale * self._growth_factor)
        tolerated = overflow & ~back_off
        # -1: the kernel counts this clean-looking step to 0, where an overflow restarts the count
        self._growth_tracker.masked_fill_(tolerated, -1)
        torch._amp_update_scale_(self._scale, self._growth_tracker, back_off.to(self._scale.dtype),
                                 self._growth_factor, self._backoff_factor, self._growth_interval)
        self._hysteresis_left.masked_fill_(grows, float(self.hysteresis))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.hysteresis > 1 and self._hysteresis_left is not None:
            state["hysteresis_left"] = float(self._hysteresis_left)  # a checkpoint reads the device anyway
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        left = state.pop("hysteresis_left", None)
        super().load_state_dict(state)
        if left is not None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
            self._hysteresis_left = torch.full((), left, device=self._device)


def build_scaler(cfg: DictConfig, device: torch.device, half_grads: bool) -> LossScaler:
    """cfg is a validated scaler config. half_grads: the optimizer's own parameters are half (O3)."""
    if cfg.kind == "none":
        return NoLossScaler(device)
    try:
        if cfg.kind == "static":
            return AmpGradScaler(device, kind="static", description=f"static {cfg.scale:g}", static=True,
                                 allow_fp16_grads=half_grads, init_scale=float(cfg.scale))
        if not cfg.enabled:
            return AmpGradScaler(device, description="dynamic (disabled)", enabled=False)
        return AmpGradScaler(
            device,
            description=_dynamic_description(cfg),
            allow_fp16_grads=half_grads,
            min_scale=cfg.min_scale,
            max_scale=cfg.max_scale,
            hysteresis=cfg.hysteresis,
            init_scale=cfg.init_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
        )
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise UnsupportedError(
            f"scaler={cfg.kind}: torch {torch.__version__} has no GradScaler for {device.type} ({exc}); "
            "use scaler=none with precision=bf16, or upgrade torch"
        ) from None


def _dynamic_description(cfg: DictConfig) -> str:
    bounds = ""
    if cfg.min_scale is not None or cfg.max_scale is not None:
        bounds = f", bounds=[{cfg.min_scale}, {cfg.max_scale}]"
    if cfg.hysteresis > 1:
        bounds += f", hysteresis={cfg.hysteresis}"
    return (f"dynamic init={cfg.init_scale:g} growth={cfg.growth_factor:g}/{cfg.growth_interval} "
            f"backoff={cfg.backoff_factor:g}{bounds}")
