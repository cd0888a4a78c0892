"""PrecisionPolicy: everything a precision mode changes, in one place.

The data of each mode lives in conf/precision/*.yaml; this class turns it into behaviour: the autocast
context, how the model is prepared (cast to half, norm layers kept fp32), the weight layout the optimizer
steps on (fp32 masters for O2), and the global TF32 flags (set for the run, restored afterwards). The loop
never branches on precision: it calls these verbs whatever the mode.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from ampctl.conf.schema import Dtype, Fp8TorchaoConfig, PrecisionConfig
from ampctl.engine import cpu_speed, devices
from ampctl.engine.precision import fp8_torchao, fp32_math
from ampctl.engine.precision.fp8_emulated import convert_linears
from ampctl.engine.precision.half import FP32MasterWeights, WeightLayout, cast_model_to_half
from ampctl.errors import UnsupportedError, UsageError

TORCH_DTYPES = {Dtype.float32: torch.float32, Dtype.float16: torch.float16, Dtype.bfloat16: torch.bfloat16}

def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bf16_if_fast(device: torch.device, advice: str) -> str:
    """advice, where bf16 is a faster mode on this device; "" where it is not (a CPU that emulates bf16)."""
    return advice if devices.has_native_bf16(device) and cpu_speed.half_runs_at_speed(device, torch.bfloat16) else ""


class PrecisionPolicy:
    """Context manager for a run: sets the global matmul flags on enter and restores them on exit."""

    def __init__(self, precision: PrecisionConfig, device: torch.device) -> None:
        """precision: the mode's config as its schema dataclass (OmegaConf.to_object of cfg.precision)."""
        self.precision = precision
        self.dtype = TORCH_DTYPES[precision.dtype]  # the half type, or float32 in fp32 and tf32
        self.uses_half = precision.autocast or precision.cast_model
        self.device = device
        self._saved_flags: Optional[dict[str, Any]] = None
        self.float8_layers: list[str] = []  # the Linear layers precision=fp8 converted, by name
        self._linears = 0

    # --- what the device can do -----------------------------------------------------------------

    def check(self) -> None:
        """Refuse what this device or torch build cannot do, naming what to use instead."""
        s, dev = self.precision, self.device
        if s.tf32 and not devices.has_tf32(dev):
            where = devices.device_name(dev) if dev.type == "cuda" else "a CPU"
            raise UnsupportedError(
                f"precision={s.name} needs TF32 tensor cores (a CUDA GPU of compute capability 8.0+, Ampere or "
                f"newer); this run is on {where}: use precision=fp32{_bf16_if_fast(dev, ', or precision=bf16 for a faster mode')}"
            )
        if s.fp8_torchao is not None and (reason := fp8_torchao.unsupported_reason(dev)):
            raise UnsupportedError(f"precision={s.name} {reason}: use precision=fp8_emulated to study FP8's "
                                   f"numerics on this machine{_bf16_if_fast(dev, ', or precision=bf16 for speed')}")
        if not self.uses_half:
            return
        if self.dtype == torch.bfloat16 and not devices.has_native_bf16(dev):
            raise UnsupportedError(
                f"precision={s.name} with dtype=bfloat16 needs native bf16 support, which "
                f"{devices.device_name(dev)} lacks; use precision=fp16 (with its loss scaler) instead"
            )
        if s.autocast and not devices.autocast_works(dev.type, self.dtype):
            raise UnsupportedError(
                f"precision={s.name}: torch {torch.__version__} has no {dev.type} autocast for "
                f"{str(self.dtype).removeprefix('torch.')}; use precision=bf16, or upgrade torch"
            )

    def combination_warnings(self, scaler_active: bool) -> list[str]:
        """Legal but suspicious pairings of this mode with a loss scaler (scaler_active: it scales and skips;
        scaler=none and a disabled dynamic scaler are the same here): warned once, not refused."""
        s = self.precision
        if self.uses_half and self.dtype == torch.bfloat16 and scaler_active:
            return [
                f"precision={s.name} runs in bfloat16, which has fp32's exponent range: a loss scaler "
                "is rarely needed there (scaler=none is the usual choice)"
            ]
        if self.uses_half and self.dtype == torch.float16 and not scaler_active:
            return [
                f"precision={s.name} runs in float16 without loss scaling: small gradients will underflow to "
                "zero (scaler=dynamic is the usual choice)"
            ]
        return []

    def slow_here(self) -> Optional[str]:
        """Why this legal mode runs much slower than fp32 on this device, in a few words; None if it does not."""
        s, dev = self.precision, self.device
        if s.fp8_emulated is not None:
            return "emulated, by design"
        if dev.type == "cpu" and self.uses_half:
            return cpu_speed.measured().why_slow(_short(self.dtype))
        return None

    def speed_warnings(self, compiled: bool) -> list[str]:
        """Legal runs that will be much slower than the user likely expects."""
        s, dev = self.precision, self.device
        if s.fp8_torchao is not None and not compiled:
            return [f"precision={s.name} without train.compile: torchao fuses FP8's scaling and casts only under "
                    "torch.compile, so eager FP8 runs slower than bf16; add train.compile=true"]
        why = self.slow_here()
        if why is None:
            return []
        if s.fp8_emulated is not None:
            return [f"precision={s.name} emulates FP8 (quantize and dequantize around fp32 matmuls): slower than "
                    "fp32 by design; it is for studying FP8's convergence and error, not for speed"]
        other = torch.float16 if self.dtype == torch.bfloat16 else torch.bfloat16
        instead = ("precision=bf16 is fast here" if other == torch.bfloat16 and cpu_speed.half_runs_at_speed(dev, other)
                   else "precision=fp32 is the fastest mode on this CPU")
        return [f"precision={s.name} on {devices.cpu_model()}: {why}: expect it to run many times slower than fp32; "
                f"{instead}"]

    # --- the run ----------------------------------------------------------------------------------

    def __enter__(self) -> "PrecisionPolicy":
        self._saved_flags = fp32_math.snapshot()
        fp32_math.set_tf32(self.precision.tf32)  # "fp32" is true fp32: TF32 is switched off, not left at default
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved_flags is not None
        fp32_math.restore(self._saved_flags)
        self._saved_flags = None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Always a context manager; "off" is enabled=False, so the loop has no branch."""
        dtype = self.dtype if self.precision.autocast else torch.bfloat16  # dtype is unused when disabled
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision.autocast)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move the model to the device and apply the mode's model converters: FP8 Linear layers (emulated or
        torchao's), the half cast of O2/O3 (half.py)."""
        model.to(self.device)
        if self.precision.fp8_emulated is not None:
            convert_linears(model, self.precision.fp8_emulated)
        if self.precision.fp8_torchao is not None:
            self._convert_to_float8(model, self.precision.fp8_torchao)
        if self.precision.cast_model:
            cast_model_to_half(model, self.dtype, self.precision.keep_norm_fp32, self.device)
        return model

    def _convert_to_float8(self, model: nn.Module, recipe: Fp8TorchaoConfig) -> None:
        self._linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        self.float8_layers = fp8_torchao.convert_linears(model, recipe)
        if not self.float8_layers:
            # A run labelled fp8 that computes nothing in FP8 would be bf16 under another name.
            raise UsageError(fp8_torchao.nothing_converted_message(recipe, self._linears))

    def weight_layout(self, model: nn.Module) -> WeightLayout:
        return FP32MasterWeights(model) if self.precision.master_weights else WeightLayout(model)

    def describe(self, scaler_description: str) -> str:
        """The resolved options, printed once at start (as Apex's "Selected optimization level")."""
        s = self.precision
        short = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
        parts = [
            f"autocast={short(self.dtype) if s.autocast else 'off'}",
            f"model_weights={short(self.dtype) if s.cast_model else 'float32'}",
            f"master_weights={'float32' if s.master_weights else 'none'}",
            "norm_layers=" + ("float32" if (s.keep_norm_fp32 or not s.cast_model) else short(self.dtype)),
            f"tf32={'on' if s.tf32 else 'off'}",
            f"loss_scale={scaler_description}",
        ]
        if s.fp8_torchao is not None:
            f8 = s.fp8_torchao
            parts.insert(0, f"fp8=torchao recipe={f8.recipe_name.value} auto_filter_small_kn={f8.auto_filter_small_kn}"
                         + (f" filter_fqns={list(f8.filter_fqns)}" if f8.filter_fqns else "")
                         + (f" ({len(self.float8_layers)} of {self._linears} Linear layers in FP8)"
                            if self.float8_layers else ""))
        if s.fp8_emulated is not None:
            f = s.fp8_emulated
            parts.insert(0, f"fp8=emulated scaling={f.scaling.value} format={f.format.value} margin={f.margin}" + (
                f" amax_history_len={f.amax_history_len} amax_compute_algo={f.amax_compute_algo.value}"
                if f.scaling == "delayed" else ""))
        return f"Selected precision={s.name}: " + ", ".join(parts)

