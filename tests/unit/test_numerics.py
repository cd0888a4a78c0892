"""Range bookkeeping against hand-computed fractions on known tensors."""

from __future__ import annotations

import math

import pytest
import torch

from ampctl.numerics import FORMATS, LOG2_LOW, RangeStats, largest_safe_scale, log2_histogram, range_counts

FMT = {f.name: f for f in FORMATS}


def test_format_ranges_are_the_formats_torch_computes_with():
    assert (FMT["fp16"].max, FMT["fp16"].min_normal, FMT["fp16"].min_subnormal) == (65504.0, 2.0**-14, 2.0**-24)
    assert FMT["bf16"].min_normal == 2.0**-126 and FMT["bf16"].min_subnormal == 2.0**-133
    assert (FMT["fp8_e4m3"].max, FMT["fp8_e4m3"].min_normal, FMT["fp8_e4m3"].min_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    assert (FMT["fp8_e5m2"].max, FMT["fp8_e5m2"].min_normal, FMT["fp8_e5m2"].min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)


def test_values_at_2_to_the_minus_30_flush_to_zero_in_fp16_but_not_in_bf16():
    x = torch.tensor([2.0**-30] * 3 + [2.0**-20] * 2 + [1.0] * 4 + [1e5] + [0.0] * 2)  # 12 values
    fp16 = range_counts(x, FMT["fp16"]).fractions()
    assert fp16 == {"to_zero": 3 / 12, "subnormal": 2 / 12, "overflow": 1 / 12}
    assert range_counts(x, FMT["bf16"]).fractions() == {"to_zero": 0.0, "subnormal": 0.0, "overflow": 0.0}
    # a loss scale of 2^16 lifts 2^-30 to 2^-14 (fp16's smallest normal) and 2^-20 to 2^-4; 1e5 overflows more
    assert range_counts(x, FMT["fp16"], scale=2.0**16).fractions() == {"to_zero": 0.0, "subnormal": 0.0,
                                                                       "overflow": 5 / 12}


def test_fp8_ranges():
    x = torch.tensor([500.0, 2.0**-8, 2.0**-11, 1.0])
    assert range_counts(x, FMT["fp8_e4m3"]).fractions() == {"to_zero": 0.25, "subnormal": 0.25, "overflow": 0.25}
    assert range_counts(x, FMT["fp8_e5m2"]).fractions() == {"to_zero": 0.0, "subnormal": 0.0, "overflow": 0.0}


def test_half_of_the_smallest_subnormal_is_where_rounding_goes_to_zero():
    x = torch.tensor([2.0**-25 * 0.99, 2.0**-25 * 1.01])
    assert range_counts(x, FMT["fp16"]).fractions()["to_zero"] == 0.5
    assert torch.tensor(2.0**-25 * 0.99).half().item() == 0 and torch.tensor(2.0**-25 * 1.01).half().item() > 0


def test_log2_histogram():
    x = torch.tensor([0.0, 1.0, 1.5, 2.0**-30, 3.0 * 2**10, float("inf")])
    counts = log2_histogram(x)
    assert int(counts.sum()) == 4  # zero and inf are not in any bin
    assert counts[0 - LOG2_LOW] == 2 and counts[-30 - LOG2_LOW] == 1 and counts[11 - LOG2_LOW] == 1


def test_largest_safe_scale():
    assert largest_safe_scale(1.0) == 2.0**14  # 65504 / 1 -> 2^15, one bit of margin
    assert largest_safe_scale(1e-3, margin_bits=0) == 2.0**25
    assert math.isnan(largest_safe_scale(0.0))


def test_range_stats_from_the_histogram_equal_the_direct_counts():
    torch.manual_seed(0)
    chunks = [torch.randn(1000) * 2.0 ** torch.randint(-40, 20, (1000,)) for _ in range(3)]
    chunks[1][:10] = 0.0
    stats = RangeStats(torch.device("cpu"), scale_log2=16)
    for chunk in chunks:
        stats.add(chunk)
    everything = torch.cat(chunks)
    for fmt in FORMATS:
        for scaled, scale in ((False, 1.0), (True, 2.0**16)):
            assert stats.fractions(fmt, scaled) == pytest.approx(range_counts(everything, fmt, scale).fractions())
    assert float(stats.max_abs) == float(everything.abs().max())


def test_stats_brought_to_the_host_together_keep_every_count():
    torch.manual_seed(0)
    stats = [RangeStats(torch.device("cpu"), scale_log2=16), RangeStats(torch.device("cpu"))]
    stats[0].add(torch.randn(1000) * 1e-6)
    stats[1].add(torch.randn(500) * 1e5)
    for original, copy in zip(stats, RangeStats.on_host(stats)):
        assert int(copy.total) == int(original.total) and float(copy.max_abs) == float(original.max_abs)
        assert torch.equal(copy.histogram, original.histogram)
        for fmt in FORMATS:
            for scaled in (False, True):
                assert copy.fractions(fmt, scaled) == original.fractions(fmt, scaled)
