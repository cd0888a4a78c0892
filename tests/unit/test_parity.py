"""Accuracy parity across seeds (reports/parity.py): the t quantiles against scipy's, the interval against a
by-hand computation, and the three verdicts on constructed cases."""

from __future__ import annotations

import math
import statistics

import pytest

from ampctl.reports import parity


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 10, 19, 20, 21, 29, 30, 45, 100, 121, 500])
def test_the_t_quantiles_are_students_and_never_narrower(df):
    scipy_stats = pytest.importorskip("scipy.stats")
    exact = scipy_stats.t.ppf(0.975, df)
    assert parity.t_975(df) >= exact - 5e-4  # tabulated to three decimals; beyond the table, the wider neighbour
    assert parity.t_975(df) <= exact * 1.03


def test_the_interval_is_the_paired_t_interval():
    base, mode = [1.00, 1.10, 0.95, 1.05], [1.01, 1.12, 0.95, 1.07]
    differences = [m - b for b, m in zip(base, mode)]
    result = parity.parity(base, mode)
    assert result.difference == pytest.approx(statistics.fmean(differences))
    assert result.half_width == pytest.approx(3.182 * statistics.stdev(differences) / math.sqrt(4))
    assert result.seed_sd == pytest.approx(statistics.stdev(base))


@pytest.mark.parametrize("base,mode,verdict", [
    ([1.00, 1.10, 0.95, 1.05], [1.001, 1.101, 0.951, 1.049], "matches"),  # tiny differences, seeds spread 0.06
    ([1.00, 1.10, 0.95, 1.05], [1.20, 1.30, 1.16, 1.24], "differs"),  # +0.2 every seed: beyond the seed noise
    ([1.00, 1.10, 0.95, 1.05], [1.10, 1.00, 1.05, 0.97], "undecided"),  # as much again, either way
    ([1.00], [1.02], "one seed"),
])
def test_the_three_verdicts_and_one_seed(base, mode, verdict):
    result = parity.parity(base, mode)
    assert result.verdict == verdict
    words = parity.words("bf16", "fp32", "loss", result)
    assert {"matches": "bf16 matches fp32 within seed noise", "differs": "bf16 differs from fp32",
            "undecided": "not decided by 4 seeds", "one seed": "with one seed: no verdict"}[verdict] in words


def test_non_finite_seeds_are_left_out_and_none_left_is_no_result():
    assert parity.parity([1.0, float("nan"), 1.1], [1.0, 2.0, 1.1]).seeds == 2
    assert parity.parity([float("nan")], [1.0]) is None
