"""`ampctl compare`'s table and plots, from the modes' run directories and the rounds they took turns in.

Each mode's step time is the median of its rounds with their range; its speedup is the median of its
round-by-round ratios to the baseline with an interval, and a verdict in words only where the interval allows
(reports/rounds.py). Memory, loss and the rest come from each run's summary. Everything is read from what the
runs recorded, so `ampctl report` renders it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ampctl import io
from ampctl.reports import plots
from ampctl.reports import rounds as rounds_stats
from ampctl.reports.rounds import Interval
from ampctl.reports.runs import RunRecord
from ampctl.reports.tables import RATES, ReportTable, rate_key, ratio, signed

BASELINES = ("fp32", "O0")
Span = tuple[int, int]


@dataclass
class ModeTiming:
    """One mode's timing: each round's median step time and rate, and what they give."""

    round_ms: list[Optional[float]]
    round_rate: list[Optional[float]]

    @property
    def step_ms(self) -> Optional[Interval]:
        measured = [v for v in self.round_ms if v is not None]
        return rounds_stats.spread(measured) if measured else None

    @property
    def rate(self) -> Optional[float]:
        measured = [v for v in self.round_rate if v is not None]
        return rounds_stats.spread(measured).value if measured else None


def mode_timing(run: RunRecord, spans: Optional[Sequence[Span]]) -> ModeTiming:
    """From the rows of each round; a comparison recorded before rounds existed has its summary's medians."""
    s = run.summary or {}
    key = rate_key(s)
    if not spans:
        return ModeTiming([s.get("median_step_time_ms")], [s.get(key)])
    return ModeTiming(rounds_stats.round_medians(run.metrics, spans),
                      rounds_stats.round_medians(run.metrics, spans, key))


def baseline_of(modes: Sequence[str]) -> Optional[str]:
    return next((m for m in modes if m in BASELINES), modes[0] if modes else None)


def comparison_table(runs: Sequence[tuple[str, RunRecord]], skipped: dict[str, str],
                     spans: Optional[Sequence[Span]] = None) -> ReportTable:
    """One row per precision mode; ratios against fp32, or the first finished mode if fp32 is absent."""
    done = [(mode, run) for mode, run in runs if not run.failed]
    baseline = baseline_of([m for m, _ in done])
    base = dict(done).get(baseline) if baseline else None
    unit = rate_key(base.summary) if base else "samples_per_s"  # type: ignore[arg-type]
    timings = {mode: mode_timing(run, spans) for mode, run in done}
    n_rounds = len(spans) if spans else 1
    columns = ["precision", "status", "compiled", "step_time_ms", "step_time_ms_low", "step_time_ms_high", unit,
               "speedup", "speedup_low", "speedup_high", "speed_verdict", "tflops", "mfu", "peak_memory_mib",
               "memory_ratio", "final_loss", "loss_delta", "skipped_steps", "final_loss_scale", "compile_s"]
    rows, verdicts = [], []
    for mode, run in runs:
        if run.failed:
            rows.append([mode, run.status] + [None] * (len(columns) - 2))
            continue
        s, b = run.summary, base.summary  # type: ignore[union-attr]
        timing, step = timings[mode], timings[mode].step_ms
        speed = (Interval(1.0, 1.0, 1.0) if mode == baseline
                 else rounds_stats.speedup(timings[baseline].round_ms, timing.round_ms))  # type: ignore[index]
        verdict = None if mode == baseline else rounds_stats.verdict(mode, baseline, speed, n_rounds)  # type: ignore[arg-type]
        if verdict:
            verdicts.append(verdict)
        memory, base_memory = s.get("peak_memory_bytes"), b.get("peak_memory_bytes")
        rows.append([
            mode, "ok", s.get("compiled", False), *_triple(step), timing.rate, *_triple(speed), verdict,
            s.get("achieved_tflops"), s.get("mfu"),
            None if memory is None else memory / 2**20,
            None if not (memory and base_memory) else memory / base_memory,
            s["final_loss"], s["final_loss"] - b["final_loss"], s["skipped_total"], s["final_loss_scale"],
            s.get("compile_s"),
        ])
    for mode in skipped:
        rows.append([mode, "skipped"] + [None] * (len(columns) - 2))
    notes = verdicts + _timing_notes(spans, baseline, timings) + _other_notes(runs, done, skipped, baseline, base)
    headers = {"precision": "mode", "step_time_ms": "step ms (rounds' range)", unit: RATES[unit],
               "speedup": "speedup (interval)", "peak_memory_mib": "peak MiB (allocator)", "memory_ratio": "memory",
               "final_loss": "final loss", "loss_delta": "Δ loss", "skipped_steps": "skipped",
               "final_loss_scale": "scale", "compile_s": "compile s", "tflops": "TFLOP/s", "mfu": "MFU"}
    formats = {unit: lambda v: f"{v:,.0f}", "peak_memory_mib": lambda v: f"{v:,.0f}", "memory_ratio": ratio,
               "final_loss": lambda v: f"{v:.4f}", "loss_delta": signed, "final_loss_scale": io.scale_label,
               "compiled": lambda v: "yes" if v else "no", "compile_s": lambda v: f"{v:.1f}",
               "tflops": lambda v: f"{v:.3g}", "mfu": lambda v: f"{v:.1%}"}
    cells = {"step_time_ms": lambda r: _with_range(r, "step_time_ms", "{:.3g}"),
             "speedup": lambda r: _with_range(r, "speedup", "{:.2f}×")}
    file_only = frozenset({"step_time_ms_low", "step_time_ms_high", "speedup_low", "speedup_high", "speed_verdict"})
    return ReportTable("precision comparison", columns, rows, notes, headers, formats, file_only, cells)


def _triple(interval: Optional[Interval]) -> list[Optional[float]]:
    return [None] * 3 if interval is None else [interval.value, interval.low, interval.high]


def _with_range(row: dict, key: str, number: str) -> str:
    low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
    text = number.format(row[key])
    if low is None or high is None or low == high:
        return text
    return f"{text} ({number.format(low).rstrip('×')}-{number.format(high)})"


def _timing_notes(spans: Optional[Sequence[Span]], baseline: Optional[str], timings: dict[str, ModeTiming]) -> list[str]:
    if not spans:
        return ["timings: each mode's summary median (recorded before compare took rounds): no spread."]
    first, last = spans[0][0], spans[-1][1]
    notes = [f"timings: {len(spans)} rounds of steps {first}-{last} (each mode's window of about "
             f"{spans[0][1] - spans[0][0] + 1} steps a round, in turns, its first step left out); step ms is the "
             f"median of a mode's rounds (their range in brackets); speedup is the median of its round-by-round "
             f"ratios to {baseline}, with a {rounds_stats.coverage(len(spans)):.0%} interval."]
    busy = rounds_stats.busy_rounds({mode: t.round_ms for mode, t in timings.items()})
    return notes + ([f"warning: {busy}."] if busy else [])


def _other_notes(runs: Sequence[tuple[str, RunRecord]], done: Sequence[tuple[str, RunRecord]],
                 skipped: dict[str, str], baseline: Optional[str], base: Optional[RunRecord]) -> list[str]:
    notes = [f"{mode} skipped: {reason}" for mode, reason in skipped.items()]
    notes += [f"{mode} {run.status}: {run.why_not_ok}" for mode, run in runs if run.failed]
    if baseline and baseline not in BASELINES:
        notes.append(f"fp32 is not in the list: speedup, memory ratio and loss delta are against {baseline}.")
    elif baseline:
        notes.append(f"speedup, memory ratio and loss delta are against {baseline} (true fp32: TF32 off).")
    # each mode's MFU is against the peak of its own matmul dtype: name each peak once
    peaks = dict.fromkeys(run.summary["peak_source"] for _, run in done if run.summary.get("peak_tflops"))
    notes += [f"MFU against {peak}." for peak in peaks]
    notes += [f"{mode} peak: {run.summary['peak_memory_source']}." for mode, run in done
              if run.summary.get("peak_memory_bytes") is None and run.summary.get("peak_memory_source")]
    if base and base.summary.get("peak_memory_source"):
        notes.append(f"peak MiB: tensor memory held by torch's allocator, as ampctl memory measures it "
                     f"({base.summary['peak_memory_source']}).")
    return notes


def comparison_images(runs: Sequence[tuple[str, RunRecord]], table: ReportTable, out_dir: Path) -> list[Path]:
    done = [(mode, run) for mode, run in runs if not run.failed and run.metrics]
    if not done:
        return []
    ok = [r for r in table.as_dicts() if r["status"] == "ok"]
    baseline = baseline_of([r["precision"] for r in ok])
    images = [plots.loss_curves(done, out_dir / "loss.png", "loss per step", baseline)]
    scale = plots.loss_scale_curves(done, out_dir / "loss_scale.png", "loss scale (x = skipped step)")
    if scale:
        images.append(scale)
    if ok:
        unit = next(c for c in table.columns if c in RATES)
        images.append(plots.throughput_memory_bars(
            [r["precision"] for r in ok],
            [Interval(r[unit], r[unit] * r["step_time_ms"] / r["step_time_ms_high"],
                      r[unit] * r["step_time_ms"] / r["step_time_ms_low"]) if r["step_time_ms_low"] else
             Interval(r[unit], r[unit], r[unit]) for r in ok],
            [Interval(r["speedup"], r["speedup_low"], r["speedup_high"]) for r in ok],
            [r["peak_memory_mib"] for r in ok], [r["memory_ratio"] for r in ok], RATES[unit], baseline,
            out_dir / "throughput_memory.png", plots.run_context(done),
        ))
    return images

