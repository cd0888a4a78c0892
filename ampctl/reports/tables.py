"""Tables and report files for a comparison, a sweep or a single run, from their run directories.

Every figure here is read from what the runs recorded (summary.json, metrics.jsonl): a report can be
rendered again at any time (`ampctl report PATH`) without re-training.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from ampctl import io, machine_load, run_files
from ampctl.engine import devices
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
    # columns of the files only (an interval's bounds): the displayed cell of another column shows them
    file_only: frozenset[str] = frozenset()
    cells: dict[str, Callable[[dict[str, Any]], str]] = field(default_factory=dict)  # column -> cell from its row
    # the columns a terminal shows (None: every shown one), a cell of its own allowed (in cells); and the line that
    # says where the others are
    screen: Optional[list[str]] = None
    screen_note: str = ""
    # the screen's columns only where every column does not fit the terminal (else the screen always)
    screen_when_narrow: bool = False
    # what the figures mean (definitions, peaks, the timing scheme): report.md's, never the screen's, where the notes
    # say the decision and why
    details: list[str] = field(default_factory=list)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]

    @property
    def shown(self) -> list[str]:
        return [c for c in self.columns if c not in self.file_only]

    def display_headers(self, columns: Optional[list[str]] = None) -> list[str]:
        return [self.headers.get(c, c) for c in columns or self.shown]

    def display_rows(self, columns: Optional[list[str]] = None) -> list[list[str]]:
        return [[self._cell(c, row) for c in columns or self.shown] for row in self.as_dicts()]

    def _cell(self, column: str, row: dict[str, Any]) -> str:
        if column not in row:  # a column of the screen's own
            return self.cells[column](row)
        value = row[column]
        if value is None:
            return fmt(None)
        if column in self.cells:
            return self.cells[column](row)
        return self.formats.get(column, fmt)(value)


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
        # whole numbers from 1,000 up, as people read them (1,013, not 1.013e+03); 4 significant digits below
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
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
        "cpu_fp16_hardware": bool(devices.instructions_for("float16", flags)),
        "cuda_tf32": torch.cuda.is_available() and devices.has_tf32(torch.device("cuda")),
        "cuda_bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    }


# --- the three tables -------------------------------------------------------------------------------


# throughput columns: the summary's own key (a number, its unit in the name, in the CSV) -> the display header
RATES = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s"}


def rate_key(summary: dict) -> str:
    return "tokens_per_s" if "tokens_per_s" in summary else "samples_per_s"


NOT_SWEPT = ("resume",)  # how a job started (a continued sweep's jobs say resume=auto), not what it ran


def swept_keys(runs: Sequence[RunRecord]) -> list[str]:
    """The override keys whose value differs between jobs, in the order they were given."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.override_values() if k not in keys and k not in NOT_SWEPT]
    return [k for k in keys if len({run.override_values().get(k) for run in runs}) > 1]


def sweep_table(runs: Sequence[RunRecord], continue_with: Optional[str] = None, note_it: bool = True) -> ReportTable:
    """One row per job. continue_with: the command that continues the sweep, said once for its interrupted jobs
    (each job of a sweep continues with the sweep, not on its own); note_it=False: not in the notes, where the
    caller says it in a line of its own."""
    keys = swept_keys(runs) or sorted({k for run in runs for k in run.override_values() if k not in NOT_SWEPT})
    # one throughput column per unit the jobs report (a sweep over recipes can hold both)
    rates = [key for key in RATES if any(not run.failed and key in run.summary for run in runs)]
    # the held-out metrics of the jobs' last evaluations (train.eval.every), as the jobs recorded them
    held_out = list(dict.fromkeys(k for run in runs if not run.failed for k in run.summary.get("eval", {})
                                  if k.startswith("eval/")))
    columns = ["job", *keys, "status", "final_loss", *held_out, "skipped_total", "final_loss_scale", *rates, "mfu"]
    rows = []
    for run in runs:
        values = [run.override_values().get(k) for k in keys]
        if run.failed:
            rows.append([run.job, *values, run.status] + [None] * (len(columns) - len(keys) - 2))
            continue
        s = run.summary
        rows.append([run.job, *values, "ok", s["final_loss"], *(s.get("eval", {}).get(k) for k in held_out),
                     s["skipped_total"], s["final_loss_scale"], *(s.get(key) for key in rates), s.get("mfu")])
    interrupted = [run for run in runs if run.status == "interrupted"]
    notes = [note for note in (not_comparable_throughput(runs),) if note]
    for run in (run for run in runs if run.failed):
        why = (run.unfinished_where if continue_with and run in interrupted else run.why_not_ok) or ""
        notes.append(f"job #{run.job} {why}" if why.startswith(run.status) else f"job #{run.job} {run.status}: {why}")
    if continue_with and interrupted and note_it:
        notes.append(f"continue the sweep with: {continue_with}")
    formats = {**{k: io.readable_value for k in keys},  # the files keep the value a sweeper drew, whole
               "final_loss": lambda v: f"{v:.4f}", "final_loss_scale": io.scale_label, "mfu": lambda v: f"{v:.1%}",
               **{key: (lambda v: f"{v:,.0f}") for key in rates},
               **{k: (lambda v: f"{v:.2%}") if k.endswith("accuracy") else (lambda v: f"{v:.4f}") for k in held_out}}
    headers = {"final_loss": "final loss", "skipped_total": "skipped", "final_loss_scale": "scale", "mfu": "MFU",
               **RATES, **{k: f"held-out {k.split('/', 1)[1]}" for k in held_out}}
    # a figure no job has (MFU where no peak is known) says nothing on screen: in the files it is an empty column
    empty = frozenset(c for i, c in enumerate(columns) if c in ("mfu", *rates) and all(r[i] is None for r in rows))
    return ReportTable("sweep", columns, rows, notes, headers, formats, file_only=empty)


def not_comparable_throughput(runs: Sequence[RunRecord]) -> str:
    """A note when the jobs' throughputs do not compare: jobs that ran at the same time on one host (a launcher
    that runs jobs at once, submitit_local or Ray, shares the cores between them) or with different torch thread
    counts. Empty when they compare (or the summaries predate these fields)."""
    done = [run for run in runs if not run.failed and "training_window" in run.summary]
    overlapping = sorted({run.job for run in done for other in done if other is not run
                          and run.summary.get("host") == other.summary.get("host")
                          and run.summary["training_window"][0] < other.summary["training_window"][1]
                          and other.summary["training_window"][0] < run.summary["training_window"][1]},
                         key=str)
    threads = {run.job: run.summary.get("torch_threads") for run in done}
    # other processes than the sweep's own took a share of the machine while a job stepped (machine_load)
    busy = [run.job for run in done if run.job not in overlapping
            and machine_load.busy(run.summary.get("others_cpu_cores"))]
    why = []
    if overlapping:
        why.append(f"jobs {', '.join(f'#{job}' for job in overlapping)} ran at the same time on one host")
    if busy:
        why.append(f"other processes took a share of the machine while {', '.join(f'#{job}' for job in busy)} ran ("
                   + ", ".join(f"#{run.job}: {run.summary['others_cpu_cores']:.1f} cores" for run in done
                               if run.job in busy) + ")")
    if len(set(threads.values())) > 1:
        why.append("torch's thread counts differ (" + ", ".join(f"#{job}: {n}" for job, n in threads.items()) + ")")
    return f"throughput not comparable between jobs: {'; '.join(why)}" if why else ""


def single_run_table(run: RunRecord) -> ReportTable:
    if run.failed:
        return ReportTable(f"run {run.path}", ["status"], [[f"{run.status}: {run.why_not_ok}"]])
    s = run.summary
    keys = ["precision", "precision_scheduled", "scaler", "recipe", "device_name", "steps", "final_loss", "tail_loss",
            "skipped_total",
            "final_loss_scale", "median_step_time_ms", "samples_per_s", "tokens_per_s", "achieved_tflops", "mfu",
            "peak_source", "compile_s", "peak_memory_bytes"]
    # each figure as the run's own lines said it (2^18, not 2.62e+05; MiB, not a byte count); the files keep them whole
    shown = {"final_loss_scale": io.scale_label, "median_step_time_ms": lambda v: f"{io.milliseconds(v)} ms",
             "peak_memory_bytes": io.format_bytes, "samples_per_s": lambda v: f"{v:,.0f}",
             "tokens_per_s": lambda v: f"{v:,.0f}", "mfu": lambda v: f"{v:.1%}", "compile_s": lambda v: f"{v:.1f} s",
             "final_loss": lambda v: f"{v:.4f}", "tail_loss": lambda v: f"{v:.4f}"}
    rows = [[k, s[k]] for k in keys if k in s and not (k == "precision_scheduled" and s[k] is None)]
    rows += [[k, v] for k, v in s.get("eval", {}).items() if k.startswith("eval")]  # the last evaluation's metrics
    rows += [[f"eval_best/{k}", v] for k, v in (s.get("eval_best") or {}).items()]
    return ReportTable(f"run {run.path}", ["key", "value"], rows, cells={
        "value": lambda r: shown[r["key"]](r["value"]) if r["key"] in shown and isinstance(r["value"], (int, float))
        and not isinstance(r["value"], bool) else fmt(r["value"])})


# --- output -----------------------------------------------------------------------------------------


def make_console() -> Console:
    """rich's console; off a terminal (a pipe, a CI log) wide enough that tables are never squeezed."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def print_line(console: Console, text: str, **options: Any) -> None:
    """One line of a report on rich's console: on a terminal wrapped at word boundaries to its width (left whole,
    the terminal broke it mid-word), off one whole (a pipe, a log: one line per note)."""
    console.print(io.wrap_words(text, console.width) if console.is_terminal else text, soft_wrap=True, **options)


def print_table(table: ReportTable, console: Optional[Console] = None) -> None:
    """The table on the console: its screen columns where it has them (the files hold every column)."""
    console = console or make_console()
    columns = table.screen or table.shown
    if table.screen and table.screen_when_narrow and _width(console, _rich_table(table, table.shown)) <= console.width:
        columns = table.shown
    rich_table = _rich_table(table, columns)
    if _width(console, rich_table) > console.width:  # `optimizer.lr` would be cut to `optimi…`
        rich_table = _rich_table(table, columns, break_after=".")
    console.print(rich_table)
    for note in table.notes + ([table.screen_note] if columns != table.shown and table.screen_note else []):
        print_line(console, f"  {note}")


def _width(console: Console, rich_table: Table) -> int:
    """The table's natural width: what it takes with no cell wrapped or cut."""
    return console.measure(rich_table, options=console.options.update_width(10_000)).maximum


LEFT_ALIGNED = ("precision", "status", "job", "key", "kind", "layer", "speed", "held_out")


def _rich_table(table: ReportTable, columns: list[str], break_after: str = "") -> Table:
    """rich's table of those columns; break_after: where the table is wider than the terminal, the character a header
    line breaks after (rich breaks headers at spaces only, and cuts a dotted key), the padding between cells
    collapsed to one space and the table drawn without vertical borders (with them, collapsed padding left the
    cells touching the borders)."""
    rich_table = Table(title=table.title, box=box.SIMPLE_HEAD if break_after else box.HEAVY_HEAD,
                       collapse_padding=bool(break_after))
    for i, (column, header) in enumerate(zip(columns, table.display_headers(columns))):
        if break_after:
            header = header.replace(break_after, break_after + "\n")
        # the first column names the row (a mode, a tensor kind): whole, the others' headers wrap to make room
        rich_table.add_column(header, justify="left" if column in LEFT_ALIGNED else "right", no_wrap=i == 0)
    for row, cells in zip(table.rows, table.display_rows(columns)):
        status = dict(zip(table.columns, row)).get("status", "ok")
        style = {"ok": None, "failed": "red"}.get(status, "yellow")
        rich_table.add_row(*cells, style=style)
    return rich_table


def markdown(table: ReportTable) -> str:
    lines = ["| " + " | ".join(table.display_headers()) + " |", "|" + "---|" * len(table.shown)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table.display_rows()]
    return "\n".join(lines + [""] + [f"- {n}" for n in [*table.notes, *table.details]]) + "\n"


def fraction_cell(v: float) -> str:
    """A fraction of values as a cell: a percentage, or 1.0e-05 when smaller than 0.01%, or 0."""
    return "0" if v == 0 else (f"{v:.2%}" if v >= 1e-4 else f"{v:.1e}")


def write_files(
    table: ReportTable, out_dir: Path, stem: str, machine: dict[str, Any], images: Sequence[Path], extra: dict,
    also: Sequence[ReportTable] = (),
) -> list[Path]:
    """<stem>.csv, <stem>.json and report.md in out_dir (report.md with the `also` tables after the main one);
    each written whole, then renamed into place."""
    csv_path, json_path, md_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json", out_dir / "report.md"

    tmp_csv = csv_path.with_name(csv_path.name + ".tmp")
    with tmp_csv.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(table.columns)
        writer.writerows(["" if v is None else v for v in row] for row in table.rows)
    os.replace(tmp_csv, csv_path)
    io.write_json(json_path, {**extra, "machine": machine, "notes": table.notes, "rows": table.as_dicts()})
    machine_lines = [f"- {k}: {v}" for k, v in machine.items()]
    report = [f"# {table.title}", "", markdown(table)]
    for other in also:
        report += [f"## {other.title}", "", markdown(other)]
    report += ["## Machine", "", *machine_lines, ""]
    report += [f"![{image.stem}]({image.name})\n" for image in images]
    io.atomic_write_text(md_path, "\n".join(report))
    return [csv_path, json_path, md_path]


def wrote(paths: Sequence[Path], out_dir: Path) -> str:
    """The line after a report: the files it wrote, by name (a report of runs with no records draws no plot)."""
    return f"wrote {', '.join(p.name for p in paths)} in {out_dir}"


def escalations_table(run: RunRecord) -> Optional[ReportTable]:
    """A run's escalations (guard.on_trip=escalate), from its summary: None for a run that made none."""
    rows = (run.summary or {}).get("escalations") or []
    if not rows:
        return None
    return ReportTable(
        "Escalations", ["number", "tripped_at", "step", "raised", "reason", "evidence"],
        [[r["number"], r["tripped_at"], r["step"], ", ".join(f"{k} -> {v}" for k, v in r["raised"].items()),
          r["reason"], r["evidence"]] for r in rows],
        headers={"number": "#", "tripped_at": "tripped at", "step": "from step"},
        notes=["each escalation raised the layers named, and the run trained again from the step's checkpoint "
               "(escalations.jsonl holds the rules in force from there)"],
        screen=["number", "tripped_at", "step", "raised"],
        screen_note="each escalation's reason and evidence in report.md and summary.json")


def run_images(runs: Sequence[tuple[str, RunRecord]], out_dir: Path) -> list[Path]:
    done = [(label, run) for label, run in runs if run.metrics]
    if not done:
        return []
    images = [plots.loss_curves(done, out_dir / "loss.png", "loss per step")]
    scale = plots.loss_scale_curves(done, out_dir / "loss_scale.png", "loss scale (x = skipped step)")
    images += [scale] if scale else []
    if len(runs) == 1:  # one run's report: its layers' errors over training, where train.diff.every recorded them
        diffs = runs[0][1].path / run_files.LAYER_ERRORS
        rows = [json.loads(line) for line in diffs.read_text().splitlines() if line.strip()] if diffs.is_file() else []
        if rows:
            images.append(plots.layer_error_heatmap(rows, out_dir / "layer_errors.png",
                                                    "each layer's error against fp32 over training"))
        blocks = runs[0][1].path / run_files.BLOCKS  # and its block scales, where telemetry.blocks_every recorded them
        rows = [json.loads(line) for line in blocks.read_text().splitlines() if line.strip()] if blocks.is_file() \
            else []
        if rows:
            images.append(plots.block_scale_heatmap(rows, out_dir / "block_scales.png",
                                                    "values each layer's blocks flushed to zero, over training"))
        rows = io.read_jsonl(runs[0][1].path / run_files.EXPERTS)  # a mixture of experts' load
        if rows:
            images.append(plots.expert_load_curves(rows, out_dir / "expert_load.png",
                                                   "the tokens each expert got, over training"))
    return images
