"""Where values fall against each floating-point format's range: the bookkeeping behind loss scaling.

A value cast to a format is rounded to nearest, ties to even, so its fate is decided by where it lies
against the format's rounding boundaries, not against the representable values themselves:

- to zero: |x| <= min_subnormal / 2 (the tie at exactly half rounds to 0, the even neighbour);
- kept only as a subnormal: |x| < min_normal - min_subnormal / 2 (from there it rounds up to min_normal);
- overflow: |x| >= max + ulp(max) / 2, where the tie rounds away from max if max's significand is odd (the
  IEEE formats: fp16, bf16, e5m2), and |x| > max + ulp(max) / 2 if it is even (e4m3fn, whose next value up
  is NaN). Non-finite values count as overflows too: they are not representable either.

The ranges come from torch.finfo, so they are the formats torch computes with. Values are classified in
float64, where every fp32/fp16/bf16 value and every power-of-two loss scale applied to it is exact, so a
gradient stored scaled (by the loss scale of its step) is judged as its true value without first being
divided in a format that would flush it. Everything is counted on the device; nothing here reads a value
back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Outcomes of a cast, in the order of RangeStats' count columns.
OUTCOMES = ("to_zero", "subnormal", "overflow")


@dataclass(frozen=True)
class FormatRange:
    name: str
    max: float
    min_normal: float
    min_subnormal: float
    overflow_from: float  # max + ulp(max) / 2: the rounding boundary above max
    overflow_at_tie: bool  # whether a value of exactly overflow_from overflows (max's significand is odd)

    @classmethod
    def of(cls, name: str, dtype: torch.dtype) -> "FormatRange":
        info = torch.finfo(dtype)
        max_value = float(info.max)
        mantissa_bits = round(-math.log2(info.eps))
        ulp_at_max = 2.0 ** (math.floor(math.log2(max_value)) - mantissa_bits)
        odd = int(max_value / ulp_at_max) % 2 == 1
        return cls(name, max_value, float(info.tiny), float(info.tiny * info.eps), max_value + ulp_at_max / 2, odd)

    @property
    def zero_up_to(self) -> float:
        """The largest magnitude that rounds to zero (ties to even: exactly half the smallest subnormal)."""
        return self.min_subnormal / 2

    @property
    def subnormal_below(self) -> float:
        """Magnitudes from here up round to min_normal or above."""
        return self.min_normal - self.min_subnormal / 2

    def boundaries(self, scale: float = 1.0) -> torch.Tensor:
        """Float64 boundaries for torch.bucketize(|x|, b) (right=False: bucket i holds b[i-1] < |x| <= b[i])
        of the values x * scale: bucket 0 exact zeros, 1 to zero, 2 subnormal, 3 normal, 4 overflow (NaN
        lands in 4 too). The format's boundaries are divided by the scale instead of the values multiplied:
        exact for a power of two (dyadic boundaries, far inside float64's range)."""
        below = lambda v: math.nextafter(v, 0.0)  # noqa: E731  "|x| < v" as "|x| <= below(v)"
        overflow_edge = self.overflow_from / scale
        return torch.tensor([0.0, self.zero_up_to / scale, below(self.subnormal_below / scale),
                             below(overflow_edge) if self.overflow_at_tie else overflow_edge], dtype=torch.float64)


def _formats() -> tuple[FormatRange, ...]:
    formats = [FormatRange.of("fp16", torch.float16), FormatRange.of("bf16", torch.bfloat16)]
    for name, dtype_name in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        if hasattr(torch, dtype_name):  # torch >= 2.1
            formats.append(FormatRange.of(name, getattr(torch, dtype_name)))
    return tuple(formats)


FORMATS = _formats()
FP16 = FORMATS[0]


def true_magnitudes(values: torch.Tensor, divided_by: float = 1.0) -> torch.Tensor:
    """|values| / divided_by in float64: exact for any stored dtype up to fp32 and a power-of-two scale, and
    correctly rounded to 53 bits for any other (dividing a scaled fp16 gradient in fp16 instead would flush
    the very values being counted)."""
    magnitudes = values.detach().abs().double()
    return magnitudes if divided_by == 1.0 else magnitudes / divided_by


def outcome_counts(magnitudes: torch.Tensor, fmt: FormatRange, scale: float = 1.0) -> torch.Tensor:
    """Counts [to_zero, subnormal, overflow] (a long tensor on the device) of float64 magnitudes multiplied by
    scale and cast to fmt. Exact zeros are none of them: they lose nothing."""
    buckets = torch.bucketize(magnitudes.flatten(), fmt.boundaries(scale).to(magnitudes.device))
    counts = torch.bincount(buckets, minlength=5)
    return counts[[1, 2, 4]]


LOG2_LOW, LOG2_HIGH = -160, 128  # bins of floor(log2 |x|): below bf16's subnormals to above its max


def log2_histogram(magnitudes: torch.Tensor) -> torch.Tensor:
    """Counts of floor(log2 |x|) for the non-zero finite values, one bin per power of two from LOG2_LOW to
    LOG2_HIGH (clamped at both ends), on the device. frexp gives the exponent exactly (a log2 in floating
    point can round a value just below a power of two up into the next bin)."""
    a = magnitudes.detach().abs().flatten()
    a = a[(a > 0) & torch.isfinite(a)]
    _, exponent = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
    bins = (exponent.long() - 1).clamp_(LOG2_LOW, LOG2_HIGH) - LOG2_LOW
    return torch.bincount(bins, minlength=LOG2_HIGH - LOG2_LOW + 1)


def largest_safe_scale(max_abs: float, fmt: FormatRange = FP16, margin_bits: int = 1) -> float:
    """The largest power-of-two loss scale that keeps max_abs * scale below fmt.max with 2**margin_bits to
    spare: the scale a dynamic scaler would settle near for these gradients."""
    if max_abs <= 0 or not math.isfinite(max_abs):
        return float("nan")
    return 2.0 ** (math.floor(math.log2(fmt.max / max_abs)) - margin_bits)


class RangeStats:
    """Accumulates, on the device, where a stream of tensors (one layer's, one tensor kind) falls in every
    format: cast as they are, and multiplied by the loss scale under study (study_scale). A tensor
    stored scaled is added with the scale it carries (divided_by) and judged as its true values. The
    log2 histogram is kept for plots; the fractions come from exact counts against the rounding boundaries."""

    def __init__(self, device: torch.device, study_scale: float = 1.0) -> None:
        self.study_scale = study_scale
        self.total = torch.zeros((), dtype=torch.long, device=device)
        self.zeros = torch.zeros((), dtype=torch.long, device=device)  # exact zeros: nothing to lose, or lost already
        self.histogram = torch.zeros(LOG2_HIGH - LOG2_LOW + 1, dtype=torch.long, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)
        # (format, scaled) -> counts [to_zero, subnormal, overflow]
        self.counts = {(f.name, scaled): torch.zeros(len(OUTCOMES), dtype=torch.long, device=device)
                       for f in FORMATS for scaled in (False, True)}

    def add(self, values: torch.Tensor, divided_by: float = 1.0) -> None:
        """Add values / divided_by (the true values of a tensor stored multiplied by a loss scale)."""
        a = true_magnitudes(values, divided_by)
        self.total += a.numel()
        self.zeros += (a == 0).sum()
        self.histogram += log2_histogram(a)
        if a.numel():
            self.max_abs = torch.maximum(self.max_abs, a.max())
        for f in FORMATS:
            self.counts[(f.name, False)] += outcome_counts(a, f)
            self.counts[(f.name, True)] += outcome_counts(a, f, self.study_scale)

    def merge(self, other: "RangeStats") -> None:
        self.total += other.total
        self.zeros += other.zeros
        self.histogram += other.histogram
        self.max_abs = torch.maximum(self.max_abs, other.max_abs)
        for key in self.counts:
            self.counts[key] += other.counts[key]

    @staticmethod
    def on_host(stats: Sequence["RangeStats"]) -> list["RangeStats"]:
        """CPU copies of many stats in one device-to-host transfer (one sync, not one per counter). Counts
        travel as float64, exact below 2^53."""
        if not stats:
            return []
        packed = torch.cat([torch.cat([s.histogram.double(), s.total.double()[None], s.zeros.double()[None],
                                       s.max_abs.double()[None], torch.cat(list(s.counts.values())).double()])
                            for s in stats]).cpu()
        bins, copies = len(stats[0].histogram), []
        row_length = bins + 3 + len(OUTCOMES) * len(stats[0].counts)
        for s, row in zip(stats, packed.split(row_length)):
            copy = RangeStats(torch.device("cpu"), s.study_scale)
            copy.histogram, copy.total, copy.zeros = row[:bins].long(), row[bins].long(), row[bins + 1].long()
            copy.max_abs = row[bins + 2]
            copy.counts = dict(zip(s.counts, row[bins + 3:].long().split(len(OUTCOMES))))
            copies.append(copy)
        return copies

    def zero_fraction(self) -> float:
        return int(self.zeros) / max(int(self.total), 1)

    def fractions(self, fmt: FormatRange, scaled: bool) -> dict[str, float]:
        """Host-side fractions of all values, exact zeros included (reads the device: for reports)."""
        total = max(int(self.total), 1)
        return {what: int(n) / total for what, n in zip(OUTCOMES, self.counts[(fmt.name, scaled)].tolist())}
