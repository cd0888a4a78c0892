"""`ampctl inspect`: where a model's values fall against fp16, bf16 and FP8 ranges, per layer.

Runs inspect.steps real training steps of the recipe under its precision mode with hooks on every leaf
module, and records, on the device, log2-magnitude histograms of activations (module outputs), activation
gradients (gradients of those outputs), weight gradients and weights. Gradients are recorded as true values
(divided by the loss scale the step used) and judged twice: as they are, and multiplied by the loss scale
under study (the mode's scaler's, or inspect.loss_scale). The hooks exist only inside the inspection: a
normal `ampctl train` has none.

For the loss-scaling picture of Micikevicius et al. (2018) for your own model, inspect in fp32
(`precision=fp32`, the default), where no value has been flushed yet.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig
from rich.console import Console

from ampctl import io, run_files
from ampctl.analysis import fp8_tensorwise
from ampctl.analysis.block_scales import (
    BLOCKS_TITLE,
    PRECISION_TITLE,
    BlockScaleRecorder,
    precision_table,
    styled_blocks,
    styled_operands,
)
from ampctl.analysis.numerics import (
    FORMATS,
    FP16,
    LOG2_LOW,
    RangeStats,
    largest_safe_scale,
)
from ampctl.analysis.ranges import GRADIENT_KINDS, KINDS, RangeRecorder
from ampctl.conf.precision_schema import GRADSCALER_INIT_SCALE
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, StepsHooks, batch_stream, run_steps
from ampctl.engine.precision.layers import legend
from ampctl.errors import UsageError
from ampctl.recipes.base import build_recipe
from ampctl.reports import plots, tables
from ampctl.reports.progress import Phases
from ampctl.reports.tables import fraction_cell
from ampctl.runner.plan import check_config

SUMMARY_TITLE, LAYERS_TITLE = "value ranges by tensor kind, all layers", "value ranges per layer"
ALSO_KEYS = {PRECISION_TITLE: "precision_layers", BLOCKS_TITLE: "block_scales",
             fp8_tensorwise.TITLE: "fp8_tensorwise"}  # their rows' keys in ranges.json


@dataclass
class Inspection:
    recorder: RangeRecorder
    study_scale: float
    run_scales: list[float]
    gradient_dtype: str = "float32"  # what the run's backward computed its gradients in
    precision: Optional[tables.ReportTable] = None  # the resolved precision of every layer
    blocks: Optional[tables.ReportTable] = None  # block-scaled layers: what their scales saturate and flush
    fp8: Optional[tables.ReportTable] = None  # plain Linear layers: what FP8's tensorwise scale would flush
    stopped_early: bool = False  # its deadline came before its last step (the steps recorded: len(run_scales))
    focus: str = "float32"  # what the run computes in: a half dtype's name, "fp8" for a converter's formats


def inspect_run(cfg: DictConfig, phase: Callable[[str], None] = lambda what: None,
                deadline: Optional[float] = None) -> Inspection:
    """cfg.inspect.steps training steps with range hooks on every leaf module; phase(what) after each part. A step
    is not started past the deadline (time.monotonic()), the first excepted."""
    policy = check_config(cfg)
    recipe = build_recipe(cfg.recipe)
    with policy:
        state = build_state(cfg, policy, recipe)
        scaled_mode = state.scaler.can_skip
        study = cfg.inspect.loss_scale
        if study is None:
            # unscaled modes: GradScaler's
            study = float(state.scaler.current_scale()) if scaled_mode else GRADSCALER_INIT_SCALE
        recorder = RangeRecorder(state.model, policy.device, study)
        run_scales: list[float] = []

        def note_the_scale() -> None:
            # the scale this step multiplies the loss by: its gradients are divided by it (a host read:
            # inspect is not a training run)
            recorder.run_scale = float(state.scaler.current_scale())
            run_scales.append(recorder.run_scale)

        phase(f"built the model, hooks on {len(recorder.layers)} leaf modules")
        n = cfg.inspect.steps
        blocks = BlockScaleRecorder(state.model)
        fp8 = fp8_tensorwise.TensorwiseFp8Recorder(state.model)
        with recorder, blocks, fp8:
            recorder.record_weights()
            hooks = StepsHooks(before_step=note_the_scale, after_step=lambda done: phase(f"recorded step {done}/{n}"),
                               enough=lambda: deadline is not None and time.monotonic() > deadline)
            run_steps(state, batch_stream(recipe, policy.device, cfg.train.seed), n, recipe, policy,
                      StepSettings.of(cfg.train), hooks)
    half = str(policy.dtype).removeprefix("torch.") if policy.uses_half else "float32"
    return Inspection(recorder, study, run_scales, half, precision_table(policy.layer_rows), blocks.table(),
                      fp8.table(), stopped_early=len(run_scales) < n, focus="fp8" if policy.converter else half)


# --- tables ---------------------------------------------------------------------------------------


def _format_columns() -> list[str]:
    return [f"{f.name}_{what}{suffix}" for f in FORMATS for what in ("to_zero", "subnormal", "overflow")
            for suffix in ("", "_scaled")]


def layer_table(inspection: Inspection) -> tables.ReportTable:
    """One row per layer and tensor kind: every format's fractions, unscaled and at the studied scale."""
    columns = ["layer", "type", "kind", "values", "max_abs", *_format_columns()]
    rows = []
    recorded = inspection.recorder.stats
    types = inspection.recorder.types()
    for (layer, kind), stats in zip(recorded, RangeStats.on_host(list(recorded.values()))):
        values: dict[str, Any] = {"layer": layer, "type": types[layer], "kind": kind, "values": int(stats.total),
                                  "max_abs": float(stats.max_abs)}
        for f in FORMATS:
            for scaled, suffix in ((False, ""), (True, "_scaled")):
                for what, fraction in stats.fractions(f, scaled).items():
                    values[f"{f.name}_{what}{suffix}"] = fraction
        rows.append([values[c] for c in columns])
    order = {k: i for i, k in enumerate(KINDS)}
    rows.sort(key=lambda r: (order[r[2]], inspection.recorder.order(r[0])))
    return tables.ReportTable(LAYERS_TITLE, columns, rows)


def summary_table(inspection: Inspection) -> tables.ReportTable:
    """One row per tensor kind, all layers together: what the terminal shows."""
    scale_text = io.scale_label(inspection.study_scale)
    columns = ["kind", "max_abs", "zero"]
    for f in FORMATS:
        columns += [f"{f.name}_to_zero", f"{f.name}_overflow"]
    columns += ["fp16_to_zero_scaled", "fp16_subnormal_scaled", "fp16_overflow_scaled"]
    rows = []
    for kind in KINDS:
        merged = _merged(inspection, kind)
        if merged is None:
            continue
        values: dict[str, Any] = {"kind": kind, "max_abs": float(merged.max_abs), "zero": merged.zero_fraction()}
        for f in FORMATS:
            fr = merged.fractions(f, scaled=False)
            values[f"{f.name}_to_zero"], values[f"{f.name}_overflow"] = fr["to_zero"], fr["overflow"]
        scaled = merged.fractions(FP16, scaled=True)
        for what in ("to_zero", "subnormal", "overflow"):
            values[f"fp16_{what}_scaled"] = scaled[what] if kind in GRADIENT_KINDS else None
        rows.append([values[c] for c in columns])
    grads = [m for m in (_merged(inspection, k) for k in GRADIENT_KINDS) if m is not None]
    max_grad = max((float(m.max_abs) for m in grads), default=0.0)
    notes = [f"fractions of all values; exact 0: values that are zero as recorded, →0: flushed to zero, subn.: "
             f"kept only as a subnormal, >max: overflow. Gradients are true values (each step's loss scale "
             f"{sorted(set(inspection.run_scales))} divided out); ×{scale_text}: multiplied by the loss scale studied."]
    notes += _lost_in_the_run(inspection, rows, columns)
    if max_grad > 0:
        safe = largest_safe_scale(max_grad)
        notes.append(f"largest loss scale keeping every gradient finite in fp16 with a factor 2 to spare: "
                     f"2^{int(math.log2(safe))} = {safe:g} (max |gradient| {max_grad:.3g}, activation and weight "
                     "gradients).")
    return _styled_summary(columns, rows, notes, inspection.study_scale, inspection.focus)




def _lost_in_the_run(inspection: Inspection, rows: list[list[Any]], columns: list[str]) -> list[str]:
    """What cannot be measured here: a run that computed its gradients in a half type recorded them after they
    went through it, so values below its range were zero already, among the exact zeros and not told apart
    from them; the →0 columns count only the values that survived. Said, with the zeros, and how to measure it."""
    if inspection.gradient_dtype == "float32":
        return []
    zeros = {row[0]: row[columns.index("zero")] for row in rows if row[0] in GRADIENT_KINDS}
    scales = sorted(set(inspection.run_scales))
    said = ", ".join(f"{fraction_cell(z)} of the {kind.replace('_', ' ')}s" for kind, z in zeros.items())
    return [f"this run computed its gradients in {inspection.gradient_dtype} (loss scale {scales}): a gradient "
            f"below {inspection.gradient_dtype}'s range at that scale was zero already when recorded, among the exact "
            f"zeros ({said}) and not told apart from them, so the →0 columns count only the values that survived. "
            f"What {inspection.gradient_dtype} would flush is measured on true values: ampctl inspect precision=fp32 "
            f"inspect.loss_scale={scales[0]:g}."]


# The summary's columns a terminal shows, by what the run computes in (Inspection.focus): the formats that decide for
# it, whole at 80 columns; every column is in report.md and ranges.csv. fp16 runs scale their gradients (×scale).
SCREEN_COLUMNS = {
    "float16": ["fp16_to_zero", "fp16_overflow", "fp16_to_zero_scaled", "fp16_overflow_scaled"],
    "bfloat16": ["bf16_to_zero", "bf16_overflow", "fp16_to_zero", "fp16_overflow"],
    "fp8": ["fp8_e4m3_to_zero", "fp8_e4m3_overflow", "fp8_e5m2_to_zero", "fp8_e5m2_overflow"],
    "float32": ["fp16_to_zero", "fp16_to_zero_scaled", "bf16_to_zero", "fp8_e4m3_to_zero"],
}


def _styled_summary(columns: list[str], rows: list[list[Any]], notes: list[str], study_scale: float,
                    focus: str = "float32") -> tables.ReportTable:
    """The summary table with its short headers and percentages (from a run, or from ranges.json again); on screen
    the columns of its focus (SCREEN_COLUMNS)."""
    scale_text = io.scale_label(study_scale)
    headers = {c: c.replace("_to_zero", " →0").replace("_overflow", " >max").replace("_subnormal", " subn.")
               .replace("fp8_", "") for c in columns}
    for c in ("fp16_to_zero_scaled", "fp16_subnormal_scaled", "fp16_overflow_scaled"):
        headers[c] = headers[c].replace("_scaled", f" ×{scale_text}")
    headers["max_abs"], headers["zero"] = "max |x|", "exact 0"
    formats = {c: fraction_cell for c in columns if c not in ("kind", "max_abs")}
    formats["max_abs"] = lambda v: f"{v:.3g}"
    screen = ["kind", "max_abs", "zero", *(c for c in SCREEN_COLUMNS.get(focus, SCREEN_COLUMNS["float32"])
                                           if c in columns)]
    return tables.ReportTable(SUMMARY_TITLE, columns, rows, notes=notes, headers=headers, formats=formats,
                              screen=screen, screen_note="every format's column in report.md and ranges.csv")


def _merged(inspection: Inspection, kind: str) -> Optional[RangeStats]:
    parts = [s for (_, k), s in inspection.recorder.stats.items() if k == kind]
    if not parts:
        return None
    merged = RangeStats(parts[0].histogram.device, parts[0].study_scale)
    for part in parts:
        merged.merge(part)
    return merged


def run_inspect(cfg: DictConfig, out_dir: Path, overrides: list[str], deadline: Optional[float] = None,
                console: Optional[Console] = None) -> int:
    """The inspection, its tables, files and plots; returns the steps it recorded (fewer than inspect.steps where
    the deadline, time.monotonic(), came first). console: where it says so (a quiet one for a study it is a phase
    of: advise says what it inspects, its tables are in its report.md)."""
    console = console or tables.make_console()
    console.print(f"ampctl inspect: {io.count_of(cfg.inspect.steps, 'step')} of precision={cfg.precision.name} with "
                  f"range hooks on every leaf module -> {out_dir}")
    inspection = inspect_run(cfg, Phases(console), deadline)
    steps = len(inspection.run_scales)
    if inspection.stopped_early:
        console.print(f"  stopped after {io.count_of(steps, 'step')} of {cfg.inspect.steps}: its deadline came")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(iter(inspection.recorder.stats.values())).histogram.device
    kind = "activation_grad" if _merged(inspection, "activation_grad") is not None else "weight_grad"
    plotted = _merged(inspection, kind)
    histogram = {"kind": kind, "log2_low": LOG2_LOW, "total": int(plotted.total),
                 "counts": plotted.histogram.cpu().tolist()}
    context = f"recipe={plots.recipe_label(cfg)} · {cfg.precision.name} · {io.count_of(steps, 'step')}"
    InspectReport(layer_table(inspection), summary_table(inspection), histogram, inspection.study_scale,
                  inspection.run_scales, overrides, tables.machine_info([{"device": device.type}]), context,
                  [t for t in (inspection.precision, inspection.blocks, inspection.fp8) if t is not None],
                  inspection.focus).write(out_dir, console)
    return steps


@dataclass
class InspectReport:
    """What an inspection's directory holds: ranges.csv / ranges.json / report.md and the two plots. Everything
    `ampctl report` needs to write them again goes into ranges.json (the summary rows, the plotted histogram,
    the precision and block-scale tables too)."""

    layers: tables.ReportTable
    summary: tables.ReportTable
    histogram: dict
    study_scale: float
    run_scales: list[float]
    overrides: list[str]
    machine: dict
    context: str = ""
    also: Sequence[tables.ReportTable] = ()
    focus: str = "float32"  # Inspection.focus: the summary's columns on screen

    def write(self, out_dir: Path, console: Console) -> None:
        from ampctl.analysis import range_plots

        label = self.histogram["kind"].replace("_grad", " gradients")
        images = [range_plots.gradient_ranges(self.histogram["counts"], self.histogram["total"], label,
                                              self.study_scale, out_dir / "gradient_ranges.png", self.context),
                  range_plots.underflow_heatmap(self.layers, out_dir / "underflow_heatmap.png", self.context)]
        extra = {"kind": "inspect", "context": self.context, "overrides": self.overrides,
                 "study_scale": self.study_scale, "run_scales": self.run_scales, "summary": self.summary.as_dicts(),
                 "summary_notes": self.summary.notes, "summary_focus": self.focus, "histogram": self.histogram,
                 **{ALSO_KEYS[t.title]: t.as_dicts() for t in self.also}}
        files = tables.write_files(self.layers, out_dir, run_files.INSPECTION, self.machine, images, extra, self.also)
        for table in self.also:
            if table.title == fp8_tensorwise.TITLE:  # one row per Linear: in the files, its worst on screen
                tables.print_line(console, fp8_tensorwise.worst_line(table))
            else:
                tables.print_table(table, console)
        tables.print_table(self.summary, console)
        console.print(tables.wrote([*files, *images], out_dir))

    @classmethod
    def read(cls, out_dir: Path) -> "InspectReport":
        """From the ranges.json an inspection wrote."""
        path = out_dir / f"{run_files.INSPECTION}.json"
        data = json.loads(path.read_text())
        if "histogram" not in data or data["histogram"].get("log2_low") != LOG2_LOW:
            raise UsageError(f"{path} was written by an older ampctl inspect (no histogram to "
                             "plot again); run ampctl inspect again")
        rows, summary_rows = data["rows"], data["summary"]
        layers = tables.ReportTable(LAYERS_TITLE, list(rows[0]) if rows else [], [list(r.values()) for r in rows],
                                    notes=data.get("notes", []))
        summary = _styled_summary(list(summary_rows[0]) if summary_rows else [],
                                  [list(r.values()) for r in summary_rows], data.get("summary_notes", []),
                                  data["study_scale"], data.get("summary_focus", "float32"))
        also = [make(list(data[key][0]), [list(r.values()) for r in data[key]])
                for key, make in (("precision_layers", lambda c, r: tables.ReportTable(
                    PRECISION_TITLE, c, r, notes=legend(row[c.index("compute")] for row in r))),
                                  ("block_scales", styled_blocks),
                                  ("fp8_tensorwise", lambda c, r: styled_operands(fp8_tensorwise.TITLE, c, r,
                                                                                  fp8_tensorwise.NOTE)))
                if data.get(key)]
        return cls(layers, summary, data["histogram"], data["study_scale"], data["run_scales"],
                   data.get("overrides", []), data["machine"], data.get("context", ""), also,
                   data.get("summary_focus", "float32"))


def rerender(out_dir: Path, console: Console) -> None:
    """`ampctl report` on an inspect directory: the tables, files and plots again from ranges.json."""
    InspectReport.read(out_dir).write(out_dir, console)
