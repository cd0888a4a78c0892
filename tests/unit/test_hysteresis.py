"""scaler.hysteresis against an independent reference: DeepSpeed's DynamicLossScaler rule written out in Python
(with fp32 rounding of each product, as the scale is an fp32 tensor), and, with hysteresis 1, torch's own
GradScaler, bit for bit. Any factors: the arithmetic is the same either way."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ampctl.engine.scaler import AmpGradScaler


def ours(overflows: list[bool], hysteresis: int, growth: float, backoff: float, interval: int,
         init: float = 1024.0, scaler_class=AmpGradScaler) -> list[float]:
    """The scale each step runs at, stepping a scaler on gradients that are inf where overflows says."""
    kwargs = {"hysteresis": hysteresis} if scaler_class is AmpGradScaler else {}
    scaler = scaler_class("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                          growth_interval=interval, **kwargs)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scales = []
    for overflow in overflows:
        scales.append(float(scaler.get_scale()) if scales else init)
        scaler.scale(weight.sum()).backward()
        if overflow:
            weight.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return scales


def reference(overflows: list[bool], hysteresis: int, growth: float, backoff: float, interval: int,
              init: float = 1024.0) -> list[float]:
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis=False), with GradScaler's separate
    growth and backoff factors."""
    scale, left, last_overflow, scales = np.float32(init), hysteresis, -1, []
    for it, overflow in enumerate(overflows):
        scales.append(float(scale))
        if overflow:
            if hysteresis == 1 or left == 1:
                scale = np.float32(np.float64(scale) * backoff)
            else:
                left -= 1
            last_overflow = it
        elif (it - last_overflow) % interval == 0:
            left = hysteresis
            scale = np.float32(np.float64(scale) * growth)
    return scales


def test_the_issue_case_three_overflows_at_1024_with_hysteresis_2():
    assert ours([True, True, True], 2, 2.0, 0.5, 1000) == [1024.0, 1024.0, 512.0]


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("growth,backoff", [(2.0, 0.5), (1.5, 0.75), (1.1, 0.9), (3.0, 0.3)])
def test_scales_follow_deepspeeds_rule_with_fp32_arithmetic(hysteresis, growth, backoff):
    rng = random.Random(hysteresis * 100 + int(growth * 10))
    overflows = [rng.random() < 0.35 for _ in range(200)]
    assert ours(overflows, hysteresis, growth, backoff, 3) == reference(overflows, hysteresis, growth, backoff, 3)


@pytest.mark.parametrize("growth,backoff", [(2.0, 0.5), (1.5, 0.75), (1.1, 0.9)])
def test_hysteresis_1_is_torchs_gradscaler_bit_for_bit(growth, backoff):
    rng = random.Random(7)
    overflows = [rng.random() < 0.3 for _ in range(200)]
    assert ours(overflows, 1, growth, backoff, 2) == ours(overflows, 1, growth, backoff, 2,
                                                          scaler_class=torch.amp.GradScaler)


def test_a_run_that_never_tolerates_an_overflow_scales_as_gradscaler_whatever_its_hysteresis():
    """Overflows far apart, each after a growth: with hysteresis 2 every one is tolerated, so compare a
    sequence of growth only, where hysteresis changes nothing: the same scales, bit for bit."""
    clean = [False] * 60
    for growth in (1.5, 1.1):
        assert ours(clean, 3, growth, 0.75, 2) == ours(clean, 1, growth, 0.75, 2, scaler_class=torch.amp.GradScaler)
