"""What ampctl says about a legal precision mode before it runs: pairings with a loss scaler that defeat the
mode, and how much slower than fp32 it will run on this machine (from the CPU probe, cpu_speed.py).

Above the engine on purpose: the engine's PrecisionPolicy is the mode's behaviour and its refusals; it never
benchmarks the machine. These words are warned once at start (runner/run.py), shown by `ampctl list` and decide
compare's default modes.
"""

from __future__ import annotations

from typing import Optional

import torch

from ampctl.analysis import cpu_speed
from ampctl.engine import devices
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import UnsupportedError


def half_runs_at_speed(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compute in this half type is not much slower than fp32 on device: always on CUDA (refusals cover
    what a GPU lacks), on a CPU as measured."""
    return device.type != "cpu" or cpu_speed.measured().runs_at_speed(str(dtype).removeprefix("torch."))


def bf16_is_fast(device: torch.device) -> bool:
    """Whether precision=bf16 is a faster mode than fp32 here (not on a CPU that converts bf16 in software)."""
    return devices.has_native_bf16(device) and half_runs_at_speed(device, torch.bfloat16)


def check(policy: PrecisionPolicy) -> None:
    """policy.check(), its refusal naming precision=bf16 as an alternative where bf16 runs at speed here."""
    try:
        policy.check()
    except UnsupportedError as refusal:
        if refusal.if_bf16_is_fast and bf16_is_fast(policy.device):
            raise refusal.adding(refusal.if_bf16_is_fast) from None
        raise


def combination_warnings(policy: PrecisionPolicy, scaler_active: bool) -> list[str]:
    """Legal but suspicious pairings of the mode with a loss scaler (scaler_active: it scales and skips;
    scaler=none and a disabled dynamic scaler are the same here): warned once, not refused."""
    s = policy.precision
    if policy.uses_half and policy.dtype == torch.bfloat16 and scaler_active:
        return [
            f"precision={s.name} runs in bfloat16, which has fp32's exponent range: a loss scaler "
            "is rarely needed there (scaler=none is the usual choice)"
        ]
    if policy.uses_half and policy.dtype == torch.float16 and not scaler_active:
        return [
            f"precision={s.name} runs in float16 without loss scaling: small gradients will underflow to "
            "zero (scaler=dynamic is the usual choice)"
        ]
    if not scaler_active and any(rule.run_in == "fp16" for rule in s.rules):
        return ["precision.rules keep layers in fp16 without loss scaling: their small gradients will underflow "
                "to zero (scaler=dynamic is the usual choice)"]
    return []


def slow_here(policy: PrecisionPolicy) -> Optional[str]:
    """Why this legal mode runs much slower than fp32 on this device, in a few words; None if it does not."""
    if policy.converter is not None and (why := policy.converter.slow_here()):
        return why
    if policy.device.type == "cpu" and policy.uses_half:
        return cpu_speed.measured().why_slow(str(policy.dtype).removeprefix("torch."))
    return None


def speed_warnings(policy: PrecisionPolicy, compiled: bool) -> list[str]:
    """Legal runs that will be much slower than the user likely expects."""
    name = policy.precision.name
    if policy.converter is not None:
        return [f"precision={name} {warning}" for warning in policy.converter.speed_warnings(compiled)]
    why = slow_here(policy)
    if why is None:
        return []
    bf16 = cpu_speed.measured().speeds.get("bfloat16") if policy.device.type == "cpu" else None
    at = f" at {'x'.join(map(str, bf16.shape))}" if bf16 is not None else ""  # the size its figure holds for
    instead = (f"precision=bf16 runs at fp32's speed or faster{at} here" if policy.dtype == torch.float16
               and bf16_is_fast(policy.device) else "precision=fp32 is the fastest mode on this CPU")
    return [f"precision={name} on {devices.cpu_model()}: {why}: expect it to run many times slower than fp32; "
            f"{instead}"]
