"""Range bookkeeping against its independent reference: what torch's own casts do to the same values."""

from __future__ import annotations

import math

import pytest
import torch

from ampctl import io
from ampctl.analysis.numerics import (
    FORMATS,
    LOG2_LOW,
    OUTCOMES,
    RangeStats,
    largest_safe_scale,
    log2_histogram,
    outcome_counts,
    true_magnitudes,
)

FMT = {f.name: f for f in FORMATS}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2}


def cast_outcomes(x: torch.Tensor, name: str) -> dict[str, int]:
    """The reference: cast fp32 values to the format with torch and look at what came out."""
    fmt, dtype = FMT[name], DTYPES[name]
    back = x.float().to(dtype).float()
    nonzero = x != 0
    if name == "fp8_e4m3":
        # e4m3fn has no inf, and torch's eager cast saturates (>= 2.12) or gives NaN (older): what the OCP spec
        # rounds past 448 (above 464; the tie at 464 goes to the even 448) is the overflow
        overflow = (x.abs() > 464) | torch.isnan(back)
    else:
        overflow = ~torch.isfinite(back)
    return {"to_zero": int((nonzero & (back == 0)).sum()),
            "subnormal": int(((back != 0) & (back.abs() < fmt.min_normal)).sum()),
            "overflow": int(overflow.sum())}


def counted(x: torch.Tensor, name: str, scale: float = 1.0) -> dict[str, int]:
    return dict(zip(OUTCOMES, outcome_counts(true_magnitudes(x), FMT[name], scale).tolist()))


def boundary_values() -> torch.Tensor:
    """Every rounding boundary of every format, one fp32 ulp either side, and both signs."""
    edges = []
    for f in FORMATS:
        for v in (f.zero_up_to, f.subnormal_below, f.overflow_from, f.min_normal, f.min_subnormal, f.max):
            center = torch.tensor(v, dtype=torch.float32)
            edges += [center, torch.nextafter(center, torch.tensor(0.0)),
                      torch.nextafter(center, torch.tensor(math.inf))]
    x = torch.stack(edges)
    return torch.cat([x, -x, torch.tensor([0.0, math.inf, -math.inf, math.nan])])


def random_values(n=20000, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 2.0 ** torch.randint(-150, 128, (n,), generator=gen).float()


def test_format_ranges_are_the_formats_torch_computes_with():
    assert (FMT["fp16"].max, FMT["fp16"].min_normal, FMT["fp16"].min_subnormal) == (65504.0, 2.0**-14, 2.0**-24)
    assert FMT["bf16"].min_normal == 2.0**-126 and FMT["bf16"].min_subnormal == 2.0**-133
    assert (FMT["fp8_e4m3"].max, FMT["fp8_e4m3"].min_normal, FMT["fp8_e4m3"].min_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    e5m2 = FMT["fp8_e5m2"]
    assert (e5m2.max, e5m2.min_normal, e5m2.min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert (FMT["fp16"].overflow_from, FMT["fp16"].overflow_at_tie) == (65520.0, True)
    assert (FMT["fp8_e4m3"].overflow_from, FMT["fp8_e4m3"].overflow_at_tie) == (464.0, False)


@pytest.mark.parametrize("name", list(DTYPES))
def test_counts_are_what_torchs_cast_does_at_every_boundary_and_on_random_values(name):
    for x in (boundary_values(), random_values()):
        assert counted(x, name) == cast_outcomes(x, name)


def test_exactly_half_the_smallest_subnormal_rounds_to_zero_ties_to_even():
    x = torch.tensor([2.0**-25, 2.0**-25 * 1.0001, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-25 * 1.0001])
    assert x.half().tolist() == [0.0, 2.0**-24, 2.0**-14, 2.0**-14 - 2.0**-24]
    assert counted(x, "fp16") == {"to_zero": 1, "subnormal": 2, "overflow": 0}


def test_a_loss_scale_moves_values_across_the_boundaries():
    x = torch.tensor([2.0**-30] * 3 + [2.0**-20] * 2 + [1.0] * 4 + [1e5] + [0.0] * 2)
    assert counted(x, "fp16") == {"to_zero": 3, "subnormal": 2, "overflow": 1}
    assert counted(x, "bf16") == {"to_zero": 0, "subnormal": 0, "overflow": 0}
    # x 2^16 lifts 2^-30 to 2^-14 (fp16's smallest normal) and 2^-20 to 2^-4; 1.0 becomes 65536: overflow
    assert counted(x, "fp16", scale=2.0**16) == {"to_zero": 0, "subnormal": 0, "overflow": 5}
    scaled = (x * 2.0**16).float()
    assert counted(x, "fp16", scale=2.0**16) == cast_outcomes(scaled, "fp16")


def test_scaled_half_gradients_are_judged_as_their_true_values():
    """The fp16 inspect defect: dividing a scaled fp16 gradient by its loss scale in fp16 flushes exactly the
    values that fp16 would flush unscaled, so they were counted as exact zeros instead of underflows."""
    true = torch.cat([torch.full((10,), 2.0**-26), torch.full((10,), 2.0**-20), torch.full((80,), 2.0**-10)])
    stored = (true * 1024).half()  # what the backward of a step with loss scale 1024 holds
    assert torch.equal(stored.float() / 1024, true)  # nothing was lost in storing it
    assert int(((stored / 1024) == 0).sum()) == 10  # the old division in fp16 flushes the 2^-26 values
    stats = RangeStats(torch.device("cpu"), study_scale=2.0**16)
    stats.add(stored, divided_by=1024)
    reference = cast_outcomes(true, "fp16")
    assert reference == {"to_zero": 10, "subnormal": 10, "overflow": 0}
    assert stats.fractions(FMT["fp16"], scaled=False) == {k: v / 100 for k, v in reference.items()}
    assert stats.fractions(FMT["fp16"], scaled=True) == {k: v / 100 for k, v in
                                                         cast_outcomes(true * 2.0**16, "fp16").items()}
    assert float(stats.max_abs) == 2.0**-10


def test_bf16_gradients_scaled_far_down_keep_their_true_values():
    true = torch.tensor([2.0**-130, 2.0**-120, 1.0])
    stats = RangeStats(torch.device("cpu"))
    stats.add((true * 2.0**20).bfloat16(), divided_by=2.0**20)
    assert stats.fractions(FMT["bf16"], scaled=False) == {"to_zero": 0.0, "subnormal": 1 / 3, "overflow": 0.0}
    assert stats.fractions(FMT["fp16"], scaled=False) == {"to_zero": 2 / 3, "subnormal": 0.0, "overflow": 0.0}


def test_log2_histogram_bins_by_the_exact_exponent():
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # log2 rounds it to 0.0
    x = torch.tensor([0.0, 1.0, 1.5, 2.0**-30, 3.0 * 2**10, float("inf"), float(below_one)]).double()
    counts = log2_histogram(x)
    assert int(counts.sum()) == 5  # zero and inf are not in any bin
    assert counts[0 - LOG2_LOW] == 2 and counts[-1 - LOG2_LOW] == 1
    assert counts[-30 - LOG2_LOW] == 1 and counts[11 - LOG2_LOW] == 1


def test_largest_safe_scale_and_its_label():
    assert largest_safe_scale(1.0) == 2.0**14  # 65504 / 1 -> 2^15, one bit of margin
    assert largest_safe_scale(1e-3, margin_bits=0) == 2.0**25
    assert math.isnan(largest_safe_scale(0.0))
    assert io.scale_label(65536.0) == "2^16" and io.scale_label(1000.0) == "1000"
    assert io.scale_label(1.0) == "1" and io.scale_label(2.0**-14) == "2^-14" and io.scale_label(float("nan")) == "nan"


def test_stats_accumulated_in_chunks_equal_the_cast_of_everything():
    chunks = [random_values(3000, seed) for seed in range(3)]
    chunks[1][:10] = 0.0
    stats = RangeStats(torch.device("cpu"), study_scale=2.0**16)
    for chunk in chunks:
        stats.add(chunk)
    everything = torch.cat(chunks)
    for name in DTYPES:
        for scaled, scale in ((False, 1.0), (True, 2.0**16)):
            assert stats.fractions(FMT[name], scaled) == {
                k: v / len(everything) for k, v in counted(everything, name, scale).items()}
        assert counted(everything, name) == cast_outcomes(everything, name)
    assert int(stats.total) == len(everything)
    assert float(stats.max_abs) == float(everything.abs().max())


def test_stats_brought_to_the_host_together_keep_every_count():
    torch.manual_seed(0)
    stats = [RangeStats(torch.device("cpu"), study_scale=2.0**16), RangeStats(torch.device("cpu"))]
    stats[0].add(torch.randn(1000) * 1e-6)
    stats[1].add(torch.randn(500) * 1e5)
    for original, copy in zip(stats, RangeStats.on_host(stats)):
        assert int(copy.total) == int(original.total) and float(copy.max_abs) == float(original.max_abs)
        assert torch.equal(copy.histogram, original.histogram)
        for fmt in FORMATS:
            for scaled in (False, True):
                assert copy.fractions(fmt, scaled) == original.fractions(fmt, scaled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_exact_zeros_are_the_values_that_are_zero_in_the_stored_dtype(dtype):
    """Values cast to the run's dtype first (as a half-precision run's gradients are): the zero count is the
    count of zeros in the stored tensor, those the cast flushed among them, and survives the trip to the host."""
    values = random_values(4000, 5)
    stored = values.to(dtype)
    stats = RangeStats(torch.device("cpu"))
    stats.add(stored, divided_by=2.0)
    expected = int((stored == 0).sum())
    assert int(stats.zeros) == expected and stats.zero_fraction() == expected / len(values)
    if dtype != torch.float32:
        assert expected > int((values == 0).sum())  # the cast flushed some
    (copy,) = RangeStats.on_host([stats])
    assert int(copy.zeros) == expected
