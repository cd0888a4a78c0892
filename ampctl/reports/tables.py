"""Tables and report files for a comparison, a sweep or a single run, from their run directories.

Every figure here is read from what the runs recorded (summary.json, metrics.jsonl): a report can be
rendered again at any time (`ampctl report PATH`) without re-training.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from rich.console import Console
from rich.table import Table

from ampctl import io
from ampctl.engine import cpu_speed, devices
from ampctl.reports import plots
from ampctl.reports.runs import RunRecord


@dataclass
class ReportTable:
    title: str
    columns: list[str]  # keys, as in the CSV and JSON
    rows: list[list[Any]]  # raw values; None where a value does not apply
    notes: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)  # column -> short display header
    formats: dict[str, Callable[[Any], str]] = field(default_factory=dict)  # column -> display format

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]

    def display_headers(self) -> list[str]:
        return [self.headers.get(c, c) for c in self.columns]

    def display_rows(self) -> list[list[str]]:
        return [[fmt(v) if v is None else self.formats.get(c, fmt)(v) for c, v in zip(self.columns, row)]
                for row in self.rows]


def ratio(value: float) -> str:
    return f"{value:.2f}×"


def signed(value: float) -> str:
    return f"{value:+.4f}"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


# --- machine ----------------------------------------------------------------------------------------


def machine_info(summaries: Sequence[dict]) -> dict[str, Any]:
    """Where the numbers came from: the runs' own device record, plus this host's CPU capabilities."""
    first = summaries[0] if summaries else {}
    flags = devices.cpu_flags()
    return {
        "device": first.get("device"),
        "device_name": first.get("device_name"),
        "torch_version": first.get("torch_version", torch.__version__),
        "cuda_version": first.get("cuda_version", torch.version.cuda),
        "cpu_model": devices.cpu_model(),
        "cpu_amx_bf16": "amx_bf16" in flags,
        "cpu_avx512_bf16": "avx512_bf16" in flags,
        "cpu_fp16_hardware": bool(cpu_speed.instructions_for("float16", flags)),
        "cuda_tf32": torch.cuda.is_available() and devices.has_tf32(torch.device("cuda")),
        "cuda_bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    }


# --- the three tables -------------------------------------------------------------------------------


# throughput columns: the summary's own key (a number, its unit in the name, in the CSV) -> the display header
RATES = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s"}


def _rate_key(summary: dict) -> str:
    return "tokens_per_s" if "tokens_per_s" in summary else "samples_per_s"


def _rate(summary: dict) -> float:
    return summary[_rate_key(summary)]


def comparison_table(runs: Sequence[tuple[str, RunRecord]], skipped: dict[str, str]) -> ReportTable:
    """One row per precision mode; ratios against fp32, or the first finished mode if fp32 is absent."""
    done = [(mode, run) for mode, run in runs if not run.failed]
    baseline = next((m for m, _ in done if m in ("fp32", "O0")), done[0][0] if done else None)
    base = dict(done).get(baseline) if baseline else None
    unit = _rate_key(base.summary) if base else "samples_per_s"
    columns = ["precision", "status", "compiled", "step_time_ms", unit, "speedup", "tflops", "mfu", "peak_memory_mib",
               "memory_ratio", "final_loss", "loss_delta", "skipped_steps", "final_loss_scale", "compile_s"]
    rows = []
    for mode, run in runs:
        if run.failed:
            rows.append([mode, run.status] + [None] * (len(columns) - 2))
            continue
        s, b = run.summary, base.summary  # type: ignore[union-attr]
        memory, base_memory = s.get("peak_memory_bytes"), b.get("peak_memory_bytes")
        rows.append([
            mode, "ok", s.get("compiled", False), s["median_step_time_ms"], _rate(s), _rate(s) / _rate(b),
            s.get("achieved_tflops"), s.get("mfu"),
            None if memory is None else memory / 2**20,
            None if not (memory and base_memory) else memory / base_memory,
            s["final_loss"], s["final_loss"] - b["final_loss"], s["skipped_total"], s["final_loss_scale"],
            s.get("compile_s"),
        ])
    for mode, reason in skipped.items():
        rows.append([mode, "skipped"] + [None] * (len(columns) - 2))
    notes = [f"{mode} skipped: {reason}" for mode, reason in skipped.items()]
    notes += [f"{mode} {run.status}: {run.why_not_ok}" for mode, run in runs if run.failed]
    if baseline and baseline not in ("fp32", "O0"):
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
    headers = {"precision": "mode", "step_time_ms": "step ms", unit: RATES[unit], "peak_memory_mib": "peak MiB (allocator)",
               "memory_ratio": "memory", "final_loss": "final loss", "loss_delta": "Δ loss",
               "skipped_steps": "skipped", "final_loss_scale": "scale", "compile_s": "compile s", "tflops": "TFLOP/s",
               "mfu": "MFU"}
    formats = {"step_time_ms": lambda v: f"{v:.1f}", unit: lambda v: f"{v:,.0f}", "speedup": ratio,
               "peak_memory_mib": lambda v: f"{v:,.0f}", "memory_ratio": ratio, "final_loss": lambda v: f"{v:.4f}",
               "loss_delta": signed, "final_loss_scale": io.scale_label, "compiled": lambda v: "yes" if v else "no",
               "compile_s": lambda v: f"{v:.1f}", "tflops": lambda v: f"{v:.3g}", "mfu": lambda v: f"{v:.1%}"}
    return ReportTable("precision comparison", columns, rows, notes, headers, formats)


def swept_keys(runs: Sequence[RunRecord]) -> list[str]:
    """The override keys whose value differs between jobs, in the order they were given."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.override_values() if k not in keys]
    return [k for k in keys if len({run.override_values().get(k) for run in runs}) > 1]


def sweep_table(runs: Sequence[RunRecord]) -> ReportTable:
    keys = swept_keys(runs) or sorted({k for run in runs for k in run.override_values()})
    # one throughput column per unit the jobs report (a sweep over recipes can hold both)
    rates = [key for key in RATES if any(not run.failed and key in run.summary for run in runs)]
    columns = ["job", *keys, "status", "final_loss", "skipped_total", "final_loss_scale", *rates, "mfu"]
    rows = []
    for run in runs:
        values = [run.override_values().get(k) for k in keys]
        if run.failed:
            rows.append([run.job, *values, run.status] + [None] * (len(columns) - len(keys) - 2))
            continue
        s = run.summary
        rows.append([run.job, *values, "ok", s["final_loss"], s["skipped_total"], s["final_loss_scale"],
                     *(s.get(key) for key in rates), s.get("mfu")])
    notes = [f"job {run.job} {run.status}: {run.why_not_ok}" for run in runs if run.failed]
    formats = {"final_loss": lambda v: f"{v:.4f}", "final_loss_scale": io.scale_label, "mfu": lambda v: f"{v:.1%}",
               **{key: (lambda v: f"{v:,.0f}") for key in rates}}
    headers = {"final_loss": "final loss", "skipped_total": "skipped", "final_loss_scale": "scale", "mfu": "MFU",
               **RATES}
    return ReportTable("sweep", columns, rows, notes, headers, formats)


def single_run_table(run: RunRecord) -> ReportTable:
    if run.failed:
        return ReportTable(f"run {run.path}", ["status"], [[f"{run.status}: {run.why_not_ok}"]])
    s = run.summary
    keys = ["precision", "scaler", "recipe", "device_name", "steps", "final_loss", "tail_loss", "skipped_total",
            "final_loss_scale", "median_step_time_ms", "samples_per_s", "tokens_per_s", "achieved_tflops", "mfu",
            "peak_source", "compile_s", "peak_memory_bytes"]
    return ReportTable(f"run {run.path}", ["key", "value"], [[k, s[k]] for k in keys if k in s])


# --- output -----------------------------------------------------------------------------------------


def make_console() -> Console:
    """rich's console; off a terminal (a pipe, a CI log) wide enough that tables are never squeezed."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def print_table(table: ReportTable, console: Optional[Console] = None) -> None:
    console = console or make_console()
    rich_table = Table(title=table.title)
    for column, header in zip(table.columns, table.display_headers()):
        rich_table.add_column(header, justify="left" if column in ("precision", "status", "job", "key", "kind", "layer") else "right")
    for row, cells in zip(table.rows, table.display_rows()):
        status = dict(zip(table.columns, row)).get("status", "ok")
        style = {"ok": None, "failed": "red"}.get(status, "yellow")
        rich_table.add_row(*cells, style=style)
    console.print(rich_table)
    for note in table.notes:
        console.print(f"  {note}")


def markdown(table: ReportTable) -> str:
    lines = ["| " + " | ".join(table.display_headers()) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table.display_rows()]
    return "\n".join(lines + [""] + [f"- {n}" for n in table.notes]) + "\n"


def write_files(
    table: ReportTable, out_dir: Path, stem: str, machine: dict[str, Any], images: Sequence[Path], extra: dict
) -> list[Path]:
    """<stem>.csv, <stem>.json and report.md in out_dir; each written whole, then renamed into place."""
    csv_path, json_path, md_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json", out_dir / "report.md"

    tmp_csv = csv_path.with_name(csv_path.name + ".tmp")
    with tmp_csv.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(table.columns)
        writer.writerows(["" if v is None else v for v in row] for row in table.rows)
    os.replace(tmp_csv, csv_path)
    io.write_json(json_path, {**extra, "machine": machine, "notes": table.notes, "rows": table.as_dicts()})
    machine_lines = [f"- {k}: {v}" for k, v in machine.items()]
    report = [f"# {table.title}", "", markdown(table), "## Machine", "", *machine_lines, ""]
    report += [f"![{image.stem}]({image.name})\n" for image in images]
    io.atomic_write_text(md_path, "\n".join(report))
    return [csv_path, json_path, md_path]


def comparison_images(runs: Sequence[tuple[str, RunRecord]], table: ReportTable, out_dir: Path) -> list[Path]:
    done = [(mode, run) for mode, run in runs if not run.failed and run.metrics]
    if not done:
        return []
    ok = [r for r in table.as_dicts() if r["status"] == "ok"]
    baseline = next((m for m in ("fp32", "O0") if m in [r["precision"] for r in ok]), ok[0]["precision"]) if ok else None
    images = [plots.loss_curves(done, out_dir / "loss.png", "loss per step", baseline)]
    scale = plots.loss_scale_curves(done, out_dir / "loss_scale.png", "loss scale (x = skipped step)")
    if scale:
        images.append(scale)
    if ok:
        unit = next(c for c in table.columns if c in RATES)
        images.append(plots.throughput_memory_bars(
            [r["precision"] for r in ok], [r[unit] for r in ok], [r["speedup"] for r in ok],
            [r["peak_memory_mib"] for r in ok], [r["memory_ratio"] for r in ok], RATES[unit], baseline,
            out_dir / "throughput_memory.png", plots.run_context(done),
        ))
    return images


def run_images(runs: Sequence[tuple[str, RunRecord]], out_dir: Path) -> list[Path]:
    done = [(label, run) for label, run in runs if run.metrics]
    if not done:
        return []
    images = [plots.loss_curves(done, out_dir / "loss.png", "loss per step")]
    scale = plots.loss_scale_curves(done, out_dir / "loss_scale.png", "loss scale (x = skipped step)")
    return images + ([scale] if scale else [])
