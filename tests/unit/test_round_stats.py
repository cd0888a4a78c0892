"""Timings in alternating rounds (reports/round_stats.py) and the comparison table built on them, against independent
computations: the windows by hand, the interval's coverage by enumerating every outcome, the ratios by hand."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from ampctl.reports import round_stats as rounds
from ampctl.reports.comparison import comparison_table
from ampctl.reports.runs import RunRecord


def test_windows_split_the_steps_after_the_warmup_into_rounds():
    assert rounds.windows(10, 60, 5) == [(11, 20), (21, 30), (31, 40), (41, 50), (51, 60)]
    assert rounds.windows(10, 63, 5)[-1] == (51, 63)  # the last takes the remainder
    assert rounds.windows(0, 4, 1) == [(1, 4)]


def test_a_rounds_median_leaves_out_its_first_step_and_the_untimed_ones():
    rows = [{"step": s, "step_time_ms": float(s)} for s in range(1, 21)]
    assert rounds.round_medians(rows, [(1, 10), (11, 20)]) == [6.0, 16.0]  # medians of 2..10 and 12..20
    assert rounds.round_medians(rows, [(11, 20)], untimed=[12, 13]) == [statistics.median(range(14, 21))]
    assert rounds.round_medians(rows[:12], [(1, 10), (11, 20)]) == [6.0, 12.0]
    assert rounds.round_medians(rows[:5], [(1, 4), (6, 9)]) == [3.0, None]  # a round the run did not reach


def brute_force_coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n values of a continuous distribution: each value falls below its
    median with probability 1/2; the interval misses the median when fewer than k fall on one side."""
    hits = sum(1 for signs in itertools.product((0, 1), repeat=n) if k <= sum(signs) <= n - k)
    return hits / 2**n


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 9, 10, 15, 20])
def test_the_median_interval_has_the_coverage_it_claims(n):
    values = [float(v) for v in range(n)]
    interval = rounds.median_interval(values)
    k = values.index(interval.low) + 1
    assert interval.high == values[n - k] and interval.value == statistics.median(values)
    assert rounds.coverage(n) == pytest.approx(brute_force_coverage(n, k))
    if n >= 5:
        assert rounds.coverage(n) >= rounds.CONFIDENCE
        # and it is the narrowest that does: one step further in falls below the confidence
        if k + 1 <= n // 2:
            assert brute_force_coverage(n, k + 1) < rounds.CONFIDENCE


@pytest.mark.parametrize("ratios,words", [
    ([1.5, 1.6, 1.62, 1.7, 1.55], "bf16 1.60x faster than fp32 (1.50-1.70, 94% interval over 5 rounds)"),
    ([0.5, 0.52, 0.48, 0.49, 0.51], "bf16 2.00x slower than fp32 (0.50x its speed; 0.48-0.52, 94% interval over 5 "
                                    "rounds)"),
    ([0.97, 1.1, 1.2, 1.05, 1.3], "bf16: no measurable difference from fp32 (1.10x; 0.97-1.30, 94% interval over 5 "
                                  "rounds)"),
])
def test_a_verdict_is_claimed_only_where_the_interval_excludes_one(ratios, words):
    base = [10.0] * len(ratios)
    speed = rounds.speedup(base, [10.0 / r for r in ratios])
    assert rounds.verdict("bf16", "fp32", speed, len(ratios)) == words


def test_one_round_gives_no_verdict(tmp_path):
    speed = rounds.speedup([10.0], [5.0])
    words = rounds.verdict("bf16", "fp32", speed, 1)
    assert words.startswith("bf16: 2.00x the speed of fp32 in one round, no interval")
    # nor does the table's speed cell (it said "2.00× faster" from one round: its low and high are the one ratio)
    spans = rounds.windows(1, 4, 1)
    runs = [("fp32", [run_with(tmp_path, "fp32", [99.0, 10.0, 10.0, 10.0], 1.0)]),
            ("bf16", [run_with(tmp_path, "bf16", [99.0, 5.0, 5.0, 5.0], 1.0)])]
    table = comparison_table(runs, {}, spans)
    [cell] = [table.cells["speed"](row) for row in table.as_dicts() if row["precision"] == "bf16"]
    assert cell == "2.00× one round"


def test_rounds_that_disagree_beyond_the_usual_spread_say_the_machine_was_busy():
    assert rounds.busy_rounds({"fp32": [10.0, 10.2, 10.1], "bf16": [5.0, 5.1, 4.9]}) is None
    said = rounds.busy_rounds({"fp32": [10.0, 16.0, 10.1], "bf16": [5.0, 5.1, None]})
    assert said.startswith("the rounds disagree beyond the usual spread (fp32's round medians 10-16 ms, 1.60x apart): "
                           "the machine was busy")


def run_with(tmp_path: Path, mode: str, step_ms: list[float], loss: float, samples_per_step: int = 32) -> RunRecord:
    metrics = [{"step": s, "step_time_ms": ms, "samples_per_s": samples_per_step * 1e3 / ms}
               for s, ms in enumerate(step_ms, 1)]
    summary = {"final_loss": loss, "skipped_total": 0, "final_loss_scale": 1.0, "samples_per_s": 0.0,
               "median_step_time_ms": statistics.median(step_ms), "peak_memory_bytes": 2**20}
    return RunRecord(tmp_path / mode, summary, metrics)


def test_the_table_gives_each_modes_rounds_and_the_speedup_of_paired_rounds(tmp_path):
    spans = rounds.windows(2, 12, 5)  # rounds of steps 3-4, 5-6, ...: one timed step each (4, 6, 8, 10, 12)
    fp32_ms = [99.0, 99.0] + [10.0, 10.0, 10.0, 11.0, 10.0, 30.0, 10.0, 12.0, 10.0, 10.0]  # round 3 hit by load
    bf16_ms = [99.0, 99.0] + [6.0, 5.0, 6.0, 5.0, 6.0, 14.0, 6.0, 6.0, 6.0, 5.0]
    runs = [("fp32", [run_with(tmp_path, "fp32", fp32_ms, 1.0)]), ("bf16", [run_with(tmp_path, "bf16", bf16_ms, 1.01)])]
    table = {r["precision"]: r for r in comparison_table(runs, {}, spans).as_dicts()}
    by_hand_fp32 = [10.0, 11.0, 30.0, 12.0, 10.0]  # the second step of each window
    by_hand_bf16 = [5.0, 5.0, 14.0, 6.0, 5.0]
    ratios = sorted(f / b for f, b in zip(by_hand_fp32, by_hand_bf16))
    assert table["fp32"]["step_time_ms"] == statistics.median(by_hand_fp32)
    assert (table["fp32"]["step_time_ms_low"], table["fp32"]["step_time_ms_high"]) == (10.0, 30.0)
    assert table["bf16"]["speedup"] == pytest.approx(statistics.median(ratios))
    assert (table["bf16"]["speedup_low"], table["bf16"]["speedup_high"]) == pytest.approx((ratios[0], ratios[-1]))
    assert table["bf16"]["samples_per_s"] == pytest.approx(32e3 / 5.0)
    assert table["bf16"]["speed_verdict"].startswith("bf16 2.00x faster than fp32 (2.00-2.20")
    assert table["bf16"]["loss_delta"] == pytest.approx(0.01)


def test_the_terminal_shows_the_columns_that_decide_whole_at_80_columns(tmp_path):
    """mode, speed with its interval and verdict, held-out parity, skipped, final scale: nothing cut at 80 columns
    (the longest labels: a compiled, checkpointed mode; a mode that did not finish); the files keep every column."""
    import io as text_io

    from rich.console import Console

    from ampctl.reports.tables import print_table

    spans = rounds.windows(2, 12, 5)
    fp32_ms, half_ms = [99.0, 99.0] + [10.0] * 10, [99.0, 99.0] + [8.13, 7.0, 8.0, 7.5, 8.2, 7.9, 8.1, 7.7, 8.0, 7.6]
    runs = [("fp32", [run_with(tmp_path, "fp32", fp32_ms, 1.0)]),
            ("fp16+compile+ac", [run_with(tmp_path, "fp16+compile+ac", half_ms, 1.0)]),
            ("bf16", [RunRecord(tmp_path / "bf16", None, [{"step": 3}])])]
    table = comparison_table(runs, {"mxfp4": "emulated, by design"}, spans)
    out = text_io.StringIO()
    print_table(table, Console(file=out, width=80, force_terminal=True, color_system=None))  # a terminal, 80 wide
    lines = out.getvalue().splitlines()
    head = next(i for i, line in enumerate(lines) if "mode" in line)
    assert all(len(line) <= 80 for line in lines) and "…" not in "".join(lines[:head + 8])
    shown = "".join(lines[head:head + 8])
    for cell in ("speed against fp32", "fp16+compile+ac", "interrupted", "skipped", "baseline", "faster",
                 "1.32× (1.27-1.43×)"):
        assert cell in shown, (cell, out.getvalue())
    assert ("every column (step ms, samples/s, MFU, peak memory, losses), how each figure is taken and against which "
            "peak, in report.md and comparison.csv") in \
        " ".join(out.getvalue().split())
    assert {"step_time_ms", "samples_per_s", "peak_memory_mib", "speedup_low"} <= set(table.columns)


def test_a_throughput_whose_median_round_is_the_slowest_has_no_negative_error_bar():
    """rate * ms / ms_high with ms == ms_high is the rate up to an ulp: 3811.638132207252 * 0.3103947297759582 /
    0.3103947297759582 is an ulp above it, which matplotlib refused as a negative error (a comparison under load)."""
    from ampctl.reports.comparison import _rate_interval

    rate, ms = 3811.638132207252, 0.3103947297759582
    assert rate * ms / ms > rate  # the ulp this guards against
    row = {"samples_per_s": rate, "step_time_ms": ms, "step_time_ms_low": ms * 0.9, "step_time_ms_high": ms}
    interval = _rate_interval(row, "samples_per_s")
    assert interval.low <= interval.value == rate <= interval.high


def test_step_times_of_a_second_and_more_are_written_as_milliseconds_not_e_notation(tmp_path):
    spans = rounds.windows(1, 5, 2)
    runs = [("fp32", [run_with(tmp_path, "fp32", [99.0, 1013.4, 1013.4, 1200.0, 1200.0], 1.0)]),
            ("bf16", [run_with(tmp_path, "bf16", [99.0, 980.2, 980.2, 990.0, 990.0], 1.0)])]
    table = comparison_table(runs, {}, spans)
    [row] = [r for r in table.as_dicts() if r["precision"] == "fp32"]
    assert table.cells["step_time_ms"](row) == "1,107 (1,013-1,200)"
    from ampctl.reports.tables import fmt

    assert fmt(12345.6) == "12,346" and fmt(0.000123) == "0.000123" and fmt(1.2345) == "1.234"


def test_many_short_rounds_are_called_busy_from_their_percentiles_not_their_extremes():
    """47 turns of 3 steps spread ~1.3x between their 10th and 90th percentiles on a quiet machine, their extremes
    1.45x; beside two busy loops 2-8x. The extremes of so many rounds would call every quiet machine busy."""
    quiet = [50.0] * 20 + [55.0] * 20 + [45.0, 62.0, 71.0, 49.0, 58.0, 53.0, 47.0]
    assert max(quiet) / min(quiet) > rounds.BUSY_SPREAD and rounds.busy_rounds({"fp32": quiet}) is None
    busy = [200.0] * 20 + [900.0] * 20 + [1300.0] * 7
    said = rounds.busy_rounds({"fp32": quiet, "bf16": busy})
    assert said is not None and said.startswith("the rounds disagree beyond the usual spread (bf16's 10th-90th "
                                                "percentile of its round medians 200-1,300 ms")
