"""Where values fall against each floating-point format's range: the bookkeeping behind loss scaling.

A format represents magnitudes up to `max`, normally down to `min_normal`, and with lost precision
(subnormals) down to `min_subnormal`; round-to-nearest sends anything below half of `min_subnormal` to zero.
The ranges come from torch.finfo, so they are the formats torch computes with. Everything is counted on the
device, as tensors; nothing here reads a value back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class FormatRange:
    name: str
    max: float
    min_normal: float
    min_subnormal: float

    @classmethod
    def of(cls, name: str, dtype: torch.dtype) -> "FormatRange":
        info = torch.finfo(dtype)
        return cls(name, float(info.max), float(info.tiny), float(info.tiny * info.eps))

    @property
    def rounds_to_zero_below(self) -> float:
        return self.min_subnormal / 2


def _formats() -> tuple[FormatRange, ...]:
    formats = [FormatRange.of("fp16", torch.float16), FormatRange.of("bf16", torch.bfloat16)]
    for name, dtype_name in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        if hasattr(torch, dtype_name):  # torch >= 2.1
            formats.append(FormatRange.of(name, getattr(torch, dtype_name)))
    return tuple(formats)


FORMATS = _formats()
FP16 = FORMATS[0]


@dataclass
class RangeCounts:
    """Counts (device tensors) of values that a format would flush to zero, keep only as subnormals, or
    overflow; out of `total` values, exact zeros included (they lose nothing)."""

    total: torch.Tensor
    to_zero: torch.Tensor
    subnormal: torch.Tensor
    overflow: torch.Tensor

    def fractions(self) -> dict[str, float]:
        """Read back (a host sync): for reports, never in the training step."""
        total = max(int(self.total), 1)
        return {"to_zero": int(self.to_zero) / total, "subnormal": int(self.subnormal) / total,
                "overflow": int(self.overflow) / total}


def range_counts(values: torch.Tensor, fmt: FormatRange, scale: float = 1.0) -> RangeCounts:
    """Where values * scale would fall in fmt."""
    a = values.detach().abs().float() * scale
    nonzero = a > 0
    return RangeCounts(
        total=torch.tensor(a.numel(), device=a.device),
        to_zero=(nonzero & (a < fmt.rounds_to_zero_below)).sum(),
        subnormal=((a >= fmt.rounds_to_zero_below) & (a < fmt.min_normal)).sum(),
        overflow=(a > fmt.max).sum(),  # inf and nan included: they are not representable either
    )


LOG2_LOW, LOG2_HIGH = -160, 128  # bins of floor(log2 |x|): below bf16's subnormals to above its max


def log2_histogram(values: torch.Tensor) -> torch.Tensor:
    """Counts of floor(log2 |x|) for the non-zero finite values, one bin per power of two from LOG2_LOW to
    LOG2_HIGH (clamped at both ends), on the device."""
    a = values.detach().abs().float().flatten()
    a = a[(a > 0) & torch.isfinite(a)]
    exponents = torch.floor(torch.log2(a)).clamp_(LOG2_LOW, LOG2_HIGH).long() - LOG2_LOW
    return torch.bincount(exponents, minlength=LOG2_HIGH - LOG2_LOW + 1)


def largest_safe_scale(max_abs: float, fmt: FormatRange = FP16, margin_bits: int = 1) -> float:
    """The largest power-of-two loss scale that keeps max_abs * scale below fmt.max with 2**margin_bits to
    spare: the scale a dynamic scaler would settle near for these gradients."""
    if max_abs <= 0 or not math.isfinite(max_abs):
        return float("nan")
    return 2.0 ** (math.floor(math.log2(fmt.max / max_abs)) - margin_bits)


class RangeStats:
    """Accumulates, on the device, what range_counts and log2_histogram say about a stream of tensors, for
    one layer and tensor kind, at scale 1 and at a power-of-two loss scale. Flushes to zero and subnormals
    start at powers of two, so they come from the histogram (a power-of-two scale only shifts its bins);
    the formats' maxima are not powers of two, so overflows are counted directly."""

    def __init__(self, device: torch.device, scale_log2: int = 0) -> None:
        self.scale_log2 = scale_log2
        self.total = torch.zeros((), dtype=torch.long, device=device)
        self.histogram = torch.zeros(LOG2_HIGH - LOG2_LOW + 1, dtype=torch.long, device=device)
        self.max_abs = torch.zeros((), device=device)
        self._overflow = {(f.name, scaled): torch.zeros((), dtype=torch.long, device=device)
                          for f in FORMATS for scaled in (False, True)}

    def add(self, values: torch.Tensor) -> None:
        a = values.detach().abs().float()
        self.total += a.numel()
        self.histogram += log2_histogram(a)
        self.max_abs = torch.maximum(self.max_abs, a.max() if a.numel() else self.max_abs)
        for f in FORMATS:
            self._overflow[(f.name, False)] += (a > f.max).sum()
            self._overflow[(f.name, True)] += (a * 2.0**self.scale_log2 > f.max).sum()

    @staticmethod
    def on_host(stats: Sequence["RangeStats"]) -> list["RangeStats"]:
        """CPU copies of many stats in one device-to-host transfer (one sync, not one per counter). Counts
        travel as float64, exact below 2^53."""
        if not stats:
            return []
        packed = torch.cat([torch.cat([s.histogram.double(), s.total.double()[None], s.max_abs.double()[None],
                                       torch.stack(list(s._overflow.values())).double()]) for s in stats]).cpu()
        bins, copies = len(stats[0].histogram), []
        for s, row in zip(stats, packed.split(bins + 2 + len(stats[0]._overflow))):
            copy = RangeStats(torch.device("cpu"), s.scale_log2)
            copy.histogram, copy.total, copy.max_abs = row[:bins].long(), row[bins].long(), row[bins + 1].float()
            copy._overflow = dict(zip(s._overflow, row[bins + 2:].long()))
            copies.append(copy)
        return copies

    def fractions(self, fmt: FormatRange, scaled: bool) -> dict[str, float]:
        """Host-side fractions (reads the device: for the report at the end)."""
        shift = self.scale_log2 if scaled else 0
        histogram = self.histogram.cpu()
        total = max(int(self.total), 1)
        exponents = torch.arange(LOG2_LOW, LOG2_HIGH + 1) + shift  # floor(log2 |x * scale|) per bin
        zero_below = int(math.log2(fmt.rounds_to_zero_below))  # exact: a power of two
        normal_from = int(math.log2(fmt.min_normal))
        return {
            "to_zero": int(histogram[exponents < zero_below].sum()) / total,
            "subnormal": int(histogram[(exponents >= zero_below) & (exponents < normal_from)].sum()) / total,
            "overflow": int(self._overflow[(fmt.name, scaled)]) / total,
        }
