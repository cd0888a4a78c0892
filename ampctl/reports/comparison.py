"""`ampctl compare`'s table and plots, from the modes' run directories, the rounds they took turns in and the
seeds they ran with.

Each mode's step time is the median of its rounds (every seed's) with their range; its speedup is the median of
its round-by-round ratios to the baseline with an interval, and a verdict in words only where the interval
allows (rounds.py). Its held-out metrics are the means over its seeds, and its difference from the baseline's is
judged against the seed-to-seed noise (parity.py): the paper's table for the user's own model. Memory and the
rest come from each run's summary. Everything is read from what the runs recorded, so `ampctl report` renders
it again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ampctl import io
from ampctl.conf import precision_schedule
from ampctl.conf.train_schema import EMA_METRIC
from ampctl.reports import parity as parity_stats
from ampctl.reports import plots, round_stats
from ampctl.reports.round_stats import Interval
from ampctl.reports.runs import RunRecord
from ampctl.reports.tables import RATES, ReportTable, rate_key, ratio, signed

BASELINES = ("fp32", "O0")
Span = tuple[int, int]
ModeRuns = tuple[str, Sequence[RunRecord]]  # a mode and its runs, one per seed, in the seeds' order


def run_dir(out_dir: Path, mode: str, seed: Optional[int], per_seed: bool) -> Path:
    """A run's directory: <out>/<mode>, or <out>/<mode>/seed_<seed> when the comparison was planned with several
    seeds (however many of them ran)."""
    mode = precision_schedule.dir_name(mode)  # a scheduled row's: no arrow in a path a Hydra override names
    return out_dir / mode / f"seed_{seed}" if per_seed else out_dir / mode


@dataclass
class ModeTiming:
    """One mode's timing: each round's median step time and rate (every seed's rounds, in order)."""

    round_ms: list[Optional[float]]
    round_rate: list[Optional[float]]

    @property
    def step_ms(self) -> Optional[Interval]:
        measured = [v for v in self.round_ms if v is not None]
        return round_stats.spread(measured) if measured else None

    @property
    def rate(self) -> Optional[float]:
        measured = [v for v in self.round_rate if v is not None]
        return round_stats.spread(measured).value if measured else None


def mode_timing(runs: Sequence[RunRecord], spans: Optional[Sequence[Span]]) -> ModeTiming:
    """From the rows of each round of each run; a comparison recorded before rounds existed has its summaries'
    medians."""
    timing = ModeTiming([], [])
    for run in runs:
        s = run.summary or {}
        if not spans:
            timing.round_ms.append(s.get("median_step_time_ms"))
            timing.round_rate.append(s.get(rate_key(s)))
            continue
        timing.round_ms += round_stats.round_medians(run.metrics, spans)
        timing.round_rate += round_stats.round_medians(run.metrics, spans, rate_key(s))
    return timing


def baseline_of(modes: Sequence[str]) -> Optional[str]:
    """The first row of an fp32 mode (its first optimizer's, where several are compared), else the first row."""
    return next((m for m in modes if m.split("+", 1)[0] in BASELINES and "+compile" not in m and "+ac" not in m),
                modes[0] if modes else None)


def held_out(run: RunRecord, metric: str) -> float:
    """The run's last held-out evaluation of metric (NaN where it has none)."""
    value = (run.summary or {}).get("eval", {}).get(f"eval/{metric}")
    return float("nan") if value is None else float(value)


def _status(runs: Sequence[RunRecord]) -> tuple[str, Optional[RunRecord]]:
    """ok when every seed's run is; else the first that is not, which the row reports."""
    bad = next((run for run in runs if run.failed), None)
    return ("ok", None) if bad is None and runs else ((bad.status if bad else "failed"), bad)


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def comparison_table(runs: Sequence[ModeRuns], skipped: dict[str, str],
                     spans: Optional[Sequence[Span]] = None) -> ReportTable:
    """One row per precision mode; ratios against fp32, or the first finished mode if fp32 is absent."""
    done = [(mode, records) for mode, records in runs if _status(records)[0] == "ok"]
    baseline = baseline_of([m for m, _ in done])
    base = dict(done).get(baseline) if baseline else None
    unit = rate_key(base[0].summary) if base else "samples_per_s"  # type: ignore[arg-type]
    seeds = max((len(records) for _, records in runs), default=1)
    metrics = eval_metrics(base) if base else []
    timings = {mode: mode_timing(records, spans) for mode, records in done}
    n_rounds = len(spans) * seeds if spans else seeds
    columns = ["precision", "status", "seeds", "compiled", "step_time_ms", "step_time_ms_low", "step_time_ms_high",
               unit, "speedup", "speedup_low", "speedup_high", "speed_verdict",
               *[f"eval_{m}" for m in metrics], *(["eval_loss_sd", "eval_loss_delta", "eval_loss_delta_interval",
                                                   "parity"] if "loss" in metrics else []),
               "tflops", "mfu", "peak_memory_mib", "memory_ratio", "final_loss", "loss_delta", "skipped_steps",
               "final_loss_scale", "compile_s", "expert_load", "expert_dropped"]
    rows, notes = [], []
    for mode, records in runs:
        status, bad = _status(records)
        if status != "ok":
            rows.append([mode, status, len(records)] + [None] * (len(columns) - 3))
            if bad is not None:
                notes.append(f"{mode} {bad.status}: {bad.why_not_ok}")
            continue
        row, words = _mode_row(mode, records, baseline, base, timings, n_rounds, metrics)  # type: ignore[arg-type]
        rows.append([row.get(c) for c in columns])
        notes += words
    for mode in skipped:
        rows.append([mode, "skipped"] + [None] * (len(columns) - 2))
    timing, busy = _timing_notes(spans, seeds, baseline, timings)
    notes += busy + _skipped_notes(skipped) + _what_ran(done)
    details = timing + _definitions(done, baseline, base)
    headers, formats, cells = _presentation(unit, metrics, baseline, n_rounds)
    # shown in the table only where they say something: columns empty (or "no") in every row stay in the files
    empty = {c for i, c in enumerate(columns) if all(row[i] is None or row[i] is False for row in rows)}
    file_only = frozenset({"step_time_ms_low", "step_time_ms_high", "speedup_low", "speedup_high", "speed_verdict",
                           "eval_loss_sd", "eval_loss_delta_interval", "parity", *([] if seeds > 1 else ["seeds"]),
                           *empty})
    # a terminal shows what decides (80 columns hold it whole); report.md and the CSV every column
    screen = ["precision", "speed", *(["held_out"] if "loss" in metrics else []), "skipped_steps", "final_loss_scale"]
    return ReportTable("precision comparison", columns, rows, notes, headers, formats, file_only, cells, screen,
                       f"every column (step ms, {RATES[unit]}, MFU, peak memory, losses), how each figure is taken "
                       "and against which peak, in report.md and comparison.csv", details=details)


def _presentation(unit: str, metrics: list[str], baseline: Optional[str], n_rounds: int) -> tuple[dict, dict, dict]:
    """The comparison's headers, number formats and composed cells (the screen's speed and held-out columns among
    them)."""
    headers = {"precision": "mode", "step_time_ms": "step ms (rounds' range)", unit: RATES[unit],
               "speedup": "speedup (interval)", "peak_memory_mib": "peak MiB (allocator)", "memory_ratio": "memory",
               "final_loss": "final loss", "loss_delta": "Δ loss", "skipped_steps": "skipped",
               "final_loss_scale": "scale", "compile_s": "compile s", "tflops": "TFLOP/s", "mfu": "MFU",
               "expert_load": "expert load (max/mean)", "expert_dropped": "dropped",
               **{f"eval_{m}": _held_out_label(m) for m in metrics}, "eval_loss_delta": "Δ held-out loss"}
    formats = {unit: lambda v: f"{v:,.0f}", "peak_memory_mib": lambda v: f"{v:,.0f}", "memory_ratio": ratio,
               "final_loss": lambda v: f"{v:.4f}", "loss_delta": signed, "final_loss_scale": io.scale_label,
               "compiled": lambda v: "yes" if v else "no", "compile_s": lambda v: f"{v:.1f}",
               "tflops": lambda v: f"{v:.3g}", "mfu": lambda v: f"{v:.1%}", "expert_load": "{:.2f}×".format,
               "expert_dropped": lambda v: f"{v:.1%}",
               **{f"eval_{m}": _held_out_format(m) for m in metrics}}
    cells = {"step_time_ms": lambda r: _with_range(r, "step_time_ms", io.milliseconds),
             "speedup": lambda r: _with_range(r, "speedup", "{:.2f}×".format),
             "eval_loss": lambda r: f"{r['eval_loss']:.4f}" + (f" (sd {r['eval_loss_sd']:.4f})"
                                                                if r.get("eval_loss_sd") is not None else ""),
             "eval_loss_delta": lambda r: f"{r['eval_loss_delta']:+.4f}" + (
                 f" ± {r['eval_loss_delta_interval']:.4f}" if r.get("eval_loss_delta_interval") is not None else "")}
    cells.update(speed=lambda r: _speed_on_screen(r, baseline, n_rounds), held_out=lambda r: r.get("parity") or (
        "baseline" if r["precision"] == baseline and r["status"] == "ok" else "-"))
    headers.update(speed="speed against " + (baseline or "fp32"), held_out="held-out loss")
    return headers, formats, cells


def _speed_on_screen(row: dict[str, Any], baseline: Optional[str], rounds: int) -> str:
    """`1.52× (1.41-1.60) faster`, `0.98× one round` (no interval, no verdict), `baseline`, or the status of a mode
    that did not finish."""
    if row["status"] != "ok":
        return row["status"]
    if row["precision"] == baseline:
        return "baseline"
    if row.get("speedup") is None:
        return "-"
    ratio = Interval(row["speedup"], row["speedup_low"], row["speedup_high"])
    said = round_stats.direction(ratio, rounds)
    return f"{_with_range(row, 'speedup', '{:.2f}×'.format)} {said or 'one round'}"


def _held_out_format(metric: str) -> Callable[[float], str]:
    return (lambda v: f"{v:.2%}") if metric.endswith("accuracy") else (lambda v: f"{v:.4f}")


def _held_out_label(metric: str) -> str:
    """`held-out loss`; the weight average's (train.ema.decay) `held-out loss (EMA)`."""
    return f"held-out {metric.removeprefix(EMA_METRIC)}" + (" (EMA)" if metric.startswith(EMA_METRIC) else "")


def eval_metrics(runs: Sequence[RunRecord]) -> list[str]:
    """The held-out metrics the baseline's runs recorded, loss first."""
    names = [k.split("/", 1)[1] for k in (runs[0].summary or {}).get("eval", {}) if k.startswith("eval/")]
    return sorted(names, key=lambda m: (m != "loss", names.index(m)))


def _mode_row(mode: str, records: Sequence[RunRecord], baseline: str, base: Sequence[RunRecord],
              timings: dict[str, ModeTiming], n_rounds: int, metrics: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A finished mode's figures (by column) and its verdicts in words."""
    summaries, base_summaries = [r.summary for r in records], [r.summary for r in base]
    timing = timings[mode]
    speed = (Interval(1.0, 1.0, 1.0) if mode == baseline
             else round_stats.speedup(timings[baseline].round_ms, timing.round_ms))
    memory, base_memory = summaries[0].get("peak_memory_bytes"), base_summaries[0].get("peak_memory_bytes")
    row: dict[str, Any] = {
        "precision": mode, "status": "ok", "seeds": len(records), "compiled": summaries[0].get("compiled", False),
        **dict(zip(("step_time_ms", "step_time_ms_low", "step_time_ms_high"), _triple(timing.step_ms))),
        rate_key(summaries[0]): timing.rate,
        **dict(zip(("speedup", "speedup_low", "speedup_high"), _triple(speed))),
        "tflops": _mean([s.get("achieved_tflops") for s in summaries]), "mfu": _mean([s.get("mfu") for s in summaries]),
        "peak_memory_mib": None if memory is None else memory / 2**20,
        "memory_ratio": None if not (memory and base_memory) else memory / base_memory,
        "final_loss": _mean([s["final_loss"] for s in summaries]),
        "loss_delta": statistics.fmean(s["final_loss"] - b["final_loss"] for s, b in zip(summaries, base_summaries)),
        "skipped_steps": _mean([s["skipped_total"] for s in summaries]),
        "final_loss_scale": summaries[0]["final_loss_scale"],
        "compile_s": _mean([s.get("compile_s") for s in summaries]),
        # a mixture of experts' load balance: the busiest expert's tokens over the mean, over the run (empty: none)
        "expert_load": _mean([s.get("expert_load") for s in summaries]),
        "expert_dropped": _mean([s.get("expert_dropped") for s in summaries]),  # with a capacity: pairs dropped
    }
    words = []
    if mode != baseline:
        # an emulated format's verdict is about the emulation: its name says so where the claim is made
        label = f"{mode} (emulated)" if summaries[0].get("emulated") else mode
        row["speed_verdict"] = round_stats.verdict(label, baseline, speed, n_rounds)
        words.append(row["speed_verdict"])
    for metric in metrics:
        values = [held_out(r, metric) for r in records]
        row[f"eval_{metric}"] = statistics.fmean(values)
    if "loss" in metrics:
        losses = [held_out(r, "loss") for r in records]
        row["eval_loss_sd"] = statistics.stdev(losses) if len(losses) > 1 else None
        if mode != baseline:
            result = parity_stats.parity([held_out(r, "loss") for r in base], losses)
            if result is not None:
                row.update(eval_loss_delta=result.difference, eval_loss_delta_interval=result.half_width,
                           parity=result.verdict)
            words.append(parity_stats.words(mode, baseline, "loss", result))
    return row, words


def _rate_interval(row: dict[str, Any], unit: str) -> Interval:
    """The mode's throughput with the range of its rounds, scaled from its step times' range. Clamped to hold the
    median: where the median round is the slowest (or the fastest), rate * ms / ms_high is the rate up to an ulp,
    and an ulp above it is a negative error bar (matplotlib refuses one)."""
    rate, ms, low_ms, high_ms = row[unit], row["step_time_ms"], row["step_time_ms_low"], row["step_time_ms_high"]
    if not low_ms:
        return Interval(rate, rate, rate)
    return Interval(rate, min(rate, rate * ms / high_ms), max(rate, rate * ms / low_ms))


def _triple(interval: Optional[Interval]) -> list[Optional[float]]:
    return [None] * 3 if interval is None else [interval.value, interval.low, interval.high]


def _with_range(row: dict, key: str, number: Callable[[float], str]) -> str:
    low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
    text = number(row[key])
    if low is None or high is None or low == high:
        return text
    return f"{text} ({number(low).rstrip('×')}-{number(high)})"


def _timing_notes(spans: Optional[Sequence[Span]], seeds: int, baseline: Optional[str],
                  timings: dict[str, ModeTiming]) -> tuple[list[str], list[str]]:
    """How the timings were taken (report.md's), and the warning where the rounds disagree (the screen's too)."""
    if not spans:
        return ["timings: each run's summary median (recorded before compare took rounds): no spread."], []
    first, last = spans[0][0], spans[-1][1]
    n = len(spans) * seeds
    each_seed = f" in each of {seeds} seeds" if seeds > 1 else ""
    speedup = (f"; speedup is the median of its round-by-round ratios to {baseline}, with a "
               f"{round_stats.coverage(n):.0%} interval" if baseline else "; no speedup: no mode to compare with "
               "finished")
    notes = [f"timings: {len(spans)} rounds of steps {first}-{last}{each_seed} (each mode's window of about "
             f"{spans[0][1] - spans[0][0] + 1} steps a round, in turns, its first step left out); step ms is the "
             f"median of a mode's {n} rounds (their range in brackets){speedup}."]
    # a scheduled row's rounds are its modes' in turn (nvfp4's before its change, bf16's after): they differ by
    # design, not because the machine was busy
    scheduled = [mode for mode in timings if precision_schedule.ARROW in mode]
    notes += [f"{mode}: its rounds span its modes' steps ({', '.join(precision_schedule.modes_in(mode))} in turn): "
              "its speed is their mix over these steps, not any one mode's." for mode in scheduled]
    busy = round_stats.busy_rounds({mode: t.round_ms for mode, t in timings.items() if mode not in scheduled})
    return notes, ([f"warning: {busy}."] if busy else [])


def _skipped_notes(skipped: dict[str, str]) -> list[str]:
    """Each reason once, with every mode it skipped (fp16 and O2 share theirs)."""
    modes: dict[str, list[str]] = {}
    for mode, reason in skipped.items():
        modes.setdefault(reason, []).append(mode)
    return [f"{', '.join(names)} skipped: {reason}" for reason, names in modes.items()]


def _definitions(done: Sequence[ModeRuns], baseline: Optional[str],
                 base: Optional[Sequence[RunRecord]]) -> list[str]:
    """What the columns mean and against what they are measured: report.md's."""
    notes = []
    if baseline and baseline.split("+", 1)[0] not in BASELINES:
        notes.append(f"fp32 is not in the list: speedup, memory ratio and loss delta are against {baseline}.")
    elif baseline:
        notes.append(f"speedup, memory ratio and loss delta are against {baseline} (true fp32: TF32 off).")
    if base and "eval" in (base[0].summary or {}):
        notes.append(f"held-out metrics: each run's last evaluation (step {base[0].summary['eval']['step']}), "
                     "the mean over the seeds; Δ held-out loss is the mean over seeds of the mode's minus "
                     f"{baseline}'s, ± its 95% interval.")
    notes += [f"{mode} is emulated: its speed is the emulation's (quantizing around fp32 matmuls), not the format's."
              for mode, runs in done if runs[0].summary.get("emulated")]
    # each mode's MFU is against the peak of its own matmul dtype: name each peak once
    peaks = dict.fromkeys(runs[0].summary["peak_source"] for _, runs in done if runs[0].summary.get("peak_tflops"))
    notes += [f"MFU against {peak}." for peak in peaks]
    notes += [f"{mode} peak: {runs[0].summary['peak_memory_source']}." for mode, runs in done
              if runs[0].summary.get("peak_memory_bytes") is None and runs[0].summary.get("peak_memory_source")]
    if base and base[0].summary.get("peak_memory_source"):
        notes.append(f"peak MiB: tensor memory held by torch's allocator, as ampctl memory measures it "
                     f"({base[0].summary['peak_memory_source']}).")
    return notes


def _what_ran(done: Sequence[ModeRuns]) -> list[str]:
    """With train.profile: what each mode's matmuls ran in (its first seed's profiled window), and the layers that
    ran otherwise than the mode meant."""
    notes = []
    for mode, runs in done:
        ran = (runs[0].summary.get("profile") or {}).get("matmul_dtypes")
        if not ran or not ran.get("shares"):
            continue
        shares = ", ".join(f"{share:.1%} in {dtype}" for dtype, share in ran["shares"].items())
        otherwise = ", ".join(f"{layer} (meant {v['meant']}, ran {v['ran']})"
                              for layer, v in (ran.get("ran_otherwise") or {}).items())
        notes.append(f"{mode} matmul FLOPs (its profiled steps): {shares}"
                     + (f"; ran otherwise than the mode meant: {otherwise}" if otherwise else "") + ".")
    return notes


def comparison_images(runs: Sequence[ModeRuns], table: ReportTable, out_dir: Path) -> list[Path]:
    done = [(mode, [r for r in records if not r.failed and r.metrics]) for mode, records in runs]
    done = [(mode, records) for mode, records in done if records]
    if not done:
        return []
    ok = [r for r in table.as_dicts() if r["status"] == "ok"]
    baseline = baseline_of([r["precision"] for r in ok])
    if max(len(records) for _, records in done) > 1:
        images = [plots.seed_band_curves(done, out_dir / "loss.png", "loss per step (mean over seeds, their range)",
                                         baseline)]
    else:
        images = [plots.loss_curves([(mode, records[0]) for mode, records in done], out_dir / "loss.png",
                                    "loss per step", baseline)]
    first_runs = [(mode, records[0]) for mode, records in done]
    scale = plots.loss_scale_curves(first_runs, out_dir / "loss_scale.png", "loss scale (x = skipped step)")
    if scale:
        images.append(scale)
    context = plots.run_context(first_runs)
    if ok and "eval_loss" in table.columns:
        images.append(plots.held_out_points(
            {mode: [held_out(r, "loss") for r in records] for mode, records in done},
            out_dir / "held_out.png", "held-out loss of each run's last evaluation (dots: seeds)", context))
    if ok:
        unit = next(c for c in table.columns if c in RATES)
        modes = [plots.ModeBars(r["precision"], _rate_interval(r, unit),
                                Interval(r["speedup"], r["speedup_low"], r["speedup_high"]), r["peak_memory_mib"],
                                r["memory_ratio"])
                 for r in ok]
        images.append(plots.throughput_memory_bars(modes, RATES[unit], baseline, out_dir / "throughput_memory.png",
                                                   context))
    return images
