"""What this CPU can do with matrix multiplications, as figures and as words: each type's measured speed against
fp32's, the verdict (at speed or slow), the MFU peak, and why a type is slow. Measured and kept by cpu_speed.py."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ampctl.analysis.assumed_cpus import ASSUME_ENV
from ampctl.engine.devices import instructions_for, instructions_wanted

FP32, HALF_TYPES = "float32", ("bfloat16", "float16")
# a half type "runs at speed" when its autocast matmul takes at most this many times fp32's time; measured figures
# sit far from it: AVX512-BF16 EPYC bf16 ~0.45x, AVX2-only EPYC bf16 ~16-46x, fp16 without AVX512-FP16 ~30-150x
SLOW_FACTOR = 1.5
PROBE_VERSION = 3  # figures of an older probe (2: no-instruction types decided by their time) are not read
BUSY_SHARE = 0.8  # of the cores, below which the probe's fp32 trials were measured on a busy machine

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class DtypeSpeed:
    """One dtype's measured matmul speed."""

    dtype: str
    tflops: float  # its best trial's rate
    relative_time: float  # the median round's time over fp32's in the same round (1.0 for fp32)
    spread: tuple[float, float]  # the quartiles of those rounds' ratios
    rounds: int
    shape: Shape
    core_share: float  # of its best trial
    # no instructions for its dot products on this CPU: slow whatever it measured (timed on the screen, for the
    # figure only)
    decided_by_flags: bool = False

    @property
    def runs_at_speed(self) -> bool:
        return not self.decided_by_flags and self.relative_time <= SLOW_FACTOR

    def ratio_words(self) -> str:
        """'0.45x fp32's time (0.44-0.47 over 40 rounds of 1024x1024x1024 matmuls)'"""
        low, high = self.spread
        return (f"{self.relative_time:.2g}x fp32's time ({low:.2g}-{high:.2g} over {self.rounds} rounds of "
                f"{'x'.join(map(str, self.shape))} matmuls)")


@dataclass(frozen=True)
class CpuSpeed:
    speeds: dict[str, DtypeSpeed]  # fp32 and each half type CPU autocast computes in
    flags: frozenset[str]
    threads: int
    measured_at: str  # ISO time
    attempts: int
    seconds: float  # of trials
    assumed: Optional[str] = None  # the kind of CPU AMPCTL_ASSUME_CPU named (its half types are that CPU's)

    @property
    def busy(self) -> bool:
        """Measured while other work held the cores: the rates are too low to be a peak."""
        return self.speeds[FP32].core_share < BUSY_SHARE

    def relative_time(self, dtype: str) -> float:
        """dtype's matmul time over fp32's; inf where CPU autocast cannot compute in it."""
        return self.speeds[dtype].relative_time if dtype in self.speeds else math.inf

    def runs_at_speed(self, dtype: str) -> bool:
        return dtype == FP32 or (dtype in self.speeds and self.speeds[dtype].runs_at_speed)

    def peak_tflops(self, dtype: str) -> Optional[float]:
        """The measured peak for MFU: fp32's, and a half type's where it runs at speed; software-converted half
        matmuls have no peak (their rate depends on the shape)."""
        if self.busy or not self.runs_at_speed(dtype) or dtype not in self.speeds:
            return None
        return self.speeds[dtype].tflops

    def why_no_peak(self, dtype: str) -> str:
        if self.busy:
            return (f"the machine was busy when this CPU was measured (the probe got {self.speeds[FP32].core_share:.0%}"
                    " of its cores): no peak to measure MFU against; `ampctl list --remeasure` when it is quiet")
        return f"{dtype} matmuls are converted in software on this CPU: no peak to measure MFU against"

    def why_slow(self, dtype: str) -> Optional[str]:
        """Why dtype's matmuls are slow here, in a few words; None where they run at speed."""
        if self.runs_at_speed(dtype):
            return None
        if dtype not in self.speeds:
            return f"torch {torch.__version__} has no CPU autocast for {dtype}"
        speed, has = self.speeds[dtype], instructions_for(dtype, self.flags)
        # the figure with its spread and size, never a bound read off it: a slow type's figure moves with the load
        # (fp16 read 9.4x-20x within half an hour here), and a bound moved with it
        low, high = speed.spread
        measured = (f"measured: {speed.relative_time:.2g}x fp32's time, {low:.2g}-{high:.2g} over {speed.rounds} "
                    f"rounds of {'x'.join(map(str, speed.shape))} matmuls")
        if has:  # measured again and still slow: the build does not use them here
            return (f"{dtype} matmuls ran slow on this CPU, which has {' and '.join(has)}: torch "
                    f"{torch.__version__} did not use them here ({measured}; {self.attempts} attempts)")
        if self.flags:  # decided by the flags, whatever the load: no instructions for its dot products
            return (f"{dtype} matmuls are converted in software on this CPU, which has no "
                    f"{instructions_wanted(dtype)} ({measured})")
        return f"{dtype} matmuls ran slow on this CPU ({measured}; no CPU flags to read)"

    def describe(self) -> list[str]:
        """One line per half type, for `ampctl list`."""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        lines = [f"fp32 matmuls: {self.speeds[FP32].tflops:.3g} TFLOP/s on {threads} (the MFU peak)"]
        for dtype in HALF_TYPES:
            has = instructions_for(dtype, self.flags)
            instructions = f"{' and '.join(has)}: yes" if has else f"{instructions_wanted(dtype)}: no"
            if dtype not in self.speeds:
                lines.append(f"{dtype}: {instructions}; no CPU autocast for it in torch {torch.__version__}")
                continue
            verdict = "runs at speed" if self.speeds[dtype].runs_at_speed else "slow"
            if self.speeds[dtype].decided_by_flags:  # its figure from the screen only: the flags decided
                instructions += "; decided by them: never faster than fp32 without"
            lines.append(f"{dtype} autocast matmuls: {self.speeds[dtype].ratio_words()}: {verdict} ({instructions})")
        lines.append(f"measured {self.measured_at} in {self.seconds:.1f} s of trials"
                     + (f", {self.attempts} attempts" if self.attempts > 1 else "")
                     + (f"; the machine was busy (the probe got {self.speeds[FP32].core_share:.0%} of its cores): "
                        "the rates are no peak, and a slow type's ratio may read low (load falls on fp32's trials "
                        "too); the verdicts stand" if self.busy else ""))
        if self.assumed is not None:
            lines.append(f"assumed: {ASSUME_ENV}={self.assumed} (its half types' figures, not this CPU's)")
        return lines

    def to_json(self) -> dict:
        return {"probe_version": PROBE_VERSION, "speeds": {k: asdict(v) for k, v in self.speeds.items()},
                "flags": sorted(self.flags), "threads": self.threads, "measured_at": self.measured_at,
                "attempts": self.attempts, "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict) -> Optional["CpuSpeed"]:
        if not isinstance(data, dict) or data.get("probe_version") != PROBE_VERSION:
            return None
        try:
            speeds = {k: DtypeSpeed(**{**v, "spread": tuple(v["spread"]), "shape": tuple(v["shape"])})
                      for k, v in data["speeds"].items()}
            if FP32 not in speeds:
                return None
            return cls(speeds, frozenset(data["flags"]), int(data["threads"]), str(data["measured_at"]),
                       int(data["attempts"]), float(data["seconds"]))
        except (KeyError, TypeError, ValueError):
            return None
