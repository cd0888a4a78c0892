"""Simulated CPUs for the probe (analysis/cpu_speed.py): matmul times from a machine's true rates, slowed by load
the way a busy machine slows them (a trial can only get slower, and gets a smaller share of the cores)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from ampctl.analysis import cpu_figures, cpu_speed

AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_ONLY = frozenset({"avx2", "fma"})
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"})


@dataclass
class SimulatedCpu:
    fp32_tflops: float = 0.18
    relative_time: dict[str, float] = field(default_factory=lambda: {"bfloat16": 0.45, "float16": 60.0})
    # load(shape, dtype, n) -> the factor (>= 1) by which the n-th trial of (shape, dtype) is slowed: 1 when idle
    load: Callable[[cpu_figures.Shape, str, int], float] = lambda _shape, _dtype, _n: 1.0
    trials: list[tuple[cpu_figures.Shape, str]] = field(default_factory=list)

    def __call__(self, shape: cpu_figures.Shape, dtype: str) -> cpu_speed.Trial:
        factor = self.load(shape, dtype, self.trials.count((shape, dtype)))
        self.trials.append((shape, dtype))
        seconds = 2 * math.prod(shape) / (self.fp32_tflops * 1e12)
        seconds *= 1.0 if dtype == cpu_figures.FP32 else self.relative_time[dtype]
        return cpu_speed.Trial(seconds * factor, 1.0 / factor)


def bursts(share: float, factor: float, seed: int = 0) -> Callable[[cpu_figures.Shape, str, int], float]:
    """A machine busy in bursts: share of the trials slowed by up to factor, at random."""
    rng = random.Random(seed)
    return lambda *_trial: 1.0 + (factor - 1.0) * rng.random() if rng.random() < share else 1.0


def always(factor: float) -> Callable[[cpu_figures.Shape, str, int], float]:
    return lambda *_trial: factor


def simulated(bf16: float, fp16: float, flags: frozenset[str] = AVX2_ONLY,
              load: Optional[Callable[[cpu_figures.Shape, str, int], float]] = None) -> cpu_figures.CpuSpeed:
    """The figures the real probe gives on a simulated CPU where bf16 and fp16 matmuls take these times fp32's."""
    cpu = SimulatedCpu(relative_time={"bfloat16": bf16, "float16": fp16})
    if load is not None:
        cpu.load = load
    return cpu_speed.probe(cpu, ["bfloat16", "float16"], flags)


def use_simulated(monkeypatch, bf16: float, fp16: float, flags: frozenset[str] = AVX2_ONLY) -> cpu_figures.CpuSpeed:
    """Every use of the CPU's figures in this test (list, warnings, compare's plan, MFU) sees this CPU."""
    speed = simulated(bf16, fp16, flags)
    monkeypatch.setattr(cpu_speed, "measured", lambda remeasure=False: speed)
    return speed
