"""What `ampctl memory` measured per mode (ModeMemory), its tables (the memory model against the measured peak; a
mixture of experts' model states per part), its files (memory.csv, memory.json, report.md, memory.png) and
`ampctl report`'s rendering of them again from memory.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from ampctl import io, run_files
from ampctl.analysis.memory.measure import MeasuredPeak
from ampctl.analysis.memory.model import ActivationLine, ModelPart, ModelStateBytes, parse_size
from ampctl.errors import UsageError
from ampctl.reports import plots, tables


@dataclass
class ModeMemory:
    label: str
    states: ModelStateBytes
    activations: int  # saved for backward by one forward at the configured batch
    peak: MeasuredPeak
    step_time_ms: Optional[float]
    batch_size: Optional[int]
    activation_line: Optional[ActivationLine] = None
    batch_estimate: Optional[int] = None
    batch_found: Optional[int] = None
    search_log: list[str] = field(default_factory=list)
    emulated: bool = False  # an emulated format: fp32 weights and matmuls, not the format's bytes or speed
    # a mixture of experts' model states per part (experts, routers, the rest): they add up to `states`
    parts: list[ModelPart] = field(default_factory=list)

    @property
    def estimate(self) -> Optional[int]:
        return None if self.states.total is None else self.states.total + self.activations


def memory_table(rows: list[ModeMemory], budget: Optional[int], budget_text: Optional[str]) -> tables.ReportTable:
    # byte counts, their unit in the column name (memory.csv holds numbers only); shorter headers on screen
    sizes = {"weights_bytes": "weights", "gradients_bytes": "grads", "master_weights_bytes": "masters",
             "optimizer_states_bytes": "optimizer", "weight_average_bytes": "EMA",
             "grad_accumulators_bytes": "fp32 accum", "activations_bytes": "activations",
             "estimate_bytes": "estimate", "measured_peak_bytes": "peak", "difference_bytes": "peak − est."}
    if not any(r.states.weight_average for r in rows):  # a column only where train.ema.decay keeps an average
        del sizes["weight_average_bytes"]
    if not any(r.states.grad_accumulators for r in rows):  # and where precision.grad_accum_dtype keeps buffers
        del sizes["grad_accumulators_bytes"]
    columns = ["precision", *sizes, "step_time_ms"]
    if budget is not None:
        columns += ["batch_estimate", "batch_found"]
    table_rows = []
    for r in rows:
        s = r.states
        values = {
            "precision": r.label, "weights_bytes": s.weights, "gradients_bytes": s.gradients,
            "master_weights_bytes": s.master_weights, "optimizer_states_bytes": s.optimizer_states,
            "weight_average_bytes": s.weight_average, "grad_accumulators_bytes": s.grad_accumulators,
            "activations_bytes": r.activations,
            "estimate_bytes": r.estimate, "measured_peak_bytes": r.peak.bytes,
            "difference_bytes": None if r.estimate is None or r.peak.bytes is None else r.peak.bytes - r.estimate,
            "step_time_ms": r.step_time_ms, "batch_estimate": r.batch_estimate, "batch_found": r.batch_found,
        }
        table_rows.append([values[c] for c in columns])
    headers = {"precision": "mode", **sizes, "step_time_ms": "step ms", "batch_estimate": "batch (est.)",
               "batch_found": "batch (found)"}
    formats = {**{c: lambda v: io.format_bytes(v, 1) for c in sizes if c != "difference_bytes"},
               "difference_bytes": lambda v: ("+" if v >= 0 else "−") + io.format_bytes(abs(v), 1),
               "step_time_ms": lambda v: f"{v:,.1f}"}
    title = "memory per precision mode" + (f" (budget {budget_text})" if budget is not None else "")
    # a terminal too narrow for every column shows the states' sum in one (each in report.md and memory.csv)
    held = [c for c in sizes if c not in ("activations_bytes", "estimate_bytes", "measured_peak_bytes",
                                          "difference_bytes")]
    screen = ["precision", "states", "activations_bytes", "estimate_bytes", "measured_peak_bytes", "difference_bytes",
              "step_time_ms", *columns[len(sizes) + 2:]]
    states = {"states": lambda row: io.format_bytes(sum(row[c] or 0 for c in held), 1)}
    return tables.ReportTable(title, columns, table_rows, notes=memory_notes(rows, budget),
                              headers={**headers, "states": "states"},
                              formats=formats, cells=states, screen=screen, screen_when_narrow=True,
                              screen_note=f"states = {' + '.join(sizes[c] for c in held)}: each in report.md and "
                                          "memory.csv")


PARTS_TITLE = "model states per part of the mixture of experts"


def parts_table(rows: list[ModeMemory]) -> Optional[tables.ReportTable]:
    """Each mode's model states split between the experts, the routers and the rest (a model without experts: none),
    counted as the whole's are: the parts add up to the mode's row of the memory table."""
    if not any(r.parts for r in rows):
        return None
    sizes = {"weights": "weights", "gradients": "grads", "master_weights": "masters",
             "optimizer_states": "optimizer", "weight_average": "EMA", "grad_accumulators": "fp32 accum"}
    for attr in ("weight_average", "grad_accumulators"):  # a column only where a mode keeps them
        if not any(getattr(part.states, attr) for r in rows for part in r.parts):
            del sizes[attr]
    columns = ["precision", "part", "parameters", *(f"{attr}_bytes" for attr in sizes), "states_bytes", "share"]
    table_rows = []
    for r in rows:
        for part in r.parts:
            total = part.states.total
            table_rows.append([r.label, part.name, part.parameters, *(getattr(part.states, a) for a in sizes), total,
                               None if total is None or not r.states.total else total / r.states.total])
    headers = {"precision": "mode", **{f"{a}_bytes": h for a, h in sizes.items()}, "states_bytes": "states",
               "share": "of states"}
    formats = {**{f"{a}_bytes": lambda v: io.format_bytes(v, 1) for a in sizes},
               "states_bytes": lambda v: io.format_bytes(v, 1), "parameters": lambda v: f"{v:,}",
               "share": lambda v: f"{v:.1%}"}
    return tables.ReportTable(PARTS_TITLE, columns, table_rows, headers=headers, formats=formats,
                              screen=["precision", "part", "parameters", "states_bytes", "share"],
                              screen_when_narrow=True,
                              screen_note=f"states = {' + '.join(sizes.values())}: each in report.md and memory.csv",
                              notes=[
        "every expert's weights, gradients and optimizer states are held, though each token computes with its "
        "router's top-k of them (FLOPs count those: ampctl train's MFU); routers: their gates."])


def memory_notes(rows: list[ModeMemory], budget: Optional[int]) -> list[str]:
    ema = " + EMA (train.ema.decay's fp32 average of the weights)" if any(r.states.weight_average for r in rows) else ""
    if any(r.states.grad_accumulators for r in rows):
        ema += " + fp32 accum (precision.grad_accum_dtype=float32's gradient buffers, 4 bytes a half weight)"
    notes = [f"estimate = weights + grads + masters (O2's fp32 master weights) + optimizer states{ema} + activations "
             "(the bytes autograd saves in one forward, autocast's half weight copies included). grads: the most "
             "gradient memory alive at once; under O2 the fp32 master gradients replace the half ones as they are "
             "made, so the larger set counts, not both."]
    source = rows[0].peak.source if rows else ""
    if source.startswith("torch.cuda"):
        notes.append("measured peak = torch.cuda.max_memory_allocated (tensors only). The caching allocator "
                     "reserved more: " + ", ".join(f"{r.label} {io.format_bytes(r.peak.reserved)}" for r in rows) +
                     "; the CUDA context and cuBLAS/cuDNN workspaces are outside both.")
    elif source:
        notes.append(f"measured peak = {source}: tensor memory of the process, the interpreter not included.")
    notes += [f"{r.label} is emulated: its bytes and step time are the emulation's (fp32 weights and matmuls, with "
              "quantized copies of each operand on top), not the format's." for r in rows if r.emulated]
    for r in rows:
        if r.peak.breakdown:
            parts = ", ".join(f"{k.replace('_', ' ')} {io.format_bytes(v)}" for k, v in r.peak.breakdown.items())
            notes.append(f"{r.label} at its peak: {parts}.")
    notes.append("Why the peak differs from the estimate: gradients are freed after each step (set_to_none) and "
                 "activations are freed as backward consumes them, so not all of both are alive at once "
                 "(measured < estimate); temporaries (attention and softmax buffers, the logits and the loss, "
                 "clipping and the fused optimizer's scratch) come on top (measured > estimate).")
    if budget is not None:
        notes.append("max batch (est.) = (budget − model states − fixed activations) / activations per sample, "
                     "from counts at two batch sizes; max batch (found): largest batch whose two real steps "
                     "stayed within the budget (CUDA only).")
    return notes


# the stacked bars of memory.png: each part of the estimate, from ModelStateBytes (None: the activations)
MEMORY_PARTS = (("weights", "weights"), ("gradients", "gradients"), ("fp32 masters", "master_weights"),
                ("optimizer states", "optimizer_states"), ("fp32 EMA", "weight_average"),
                ("fp32 grad accum", "grad_accumulators"), ("activations", None))


def write_memory_report(out_dir: Path, results: list[ModeMemory], budget_text: Optional[str], machine: dict,
                        overrides: list[str], console: Console, context: str = "") -> None:
    """memory.csv, memory.json (everything needed to render it again) and report.md; the table printed."""
    budget = None if budget_text is None else parse_size(budget_text)
    table = memory_table(results, budget, budget_text)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = {"kind": "memory", "overrides": overrides, "budget": budget_text, "budget_bytes": budget,
             "modes": [_mode_record(r) for r in results]}
    image = plots.memory_bars([r.label for r in results],
                              {part: [getattr(r.states, attr) if attr else r.activations for r in results]
                               for part, attr in MEMORY_PARTS},
                              [r.peak.bytes for r in results], out_dir / "memory.png", context)
    parts = parts_table(results)
    also = [parts] if parts is not None else []
    files = tables.write_files(table, out_dir, run_files.MEMORY, machine, [image], {**extra, "context": context}, also)
    tables.print_table(table, console)
    for extra_table in also:
        tables.print_table(extra_table, console)
    console.print(tables.wrote([*files, image], out_dir))


def rerender(out_dir: Path, console: Console) -> None:
    """`ampctl report` on a memory directory: the table again from memory.json."""
    data = json.loads((out_dir / f"{run_files.MEMORY}.json").read_text())
    if any("master_gradients" in m["model_states"] for m in data["modes"]):
        raise UsageError(f"{out_dir / 'memory.json'} was written by an older ampctl memory (it counted O2's half and "
                         "fp32 gradients both); run ampctl memory again")
    write_memory_report(out_dir, [_from_record(m) for m in data["modes"]], data.get("budget"), data["machine"],
                        data.get("overrides", []), console, data.get("context", ""))


def _mode_record(r: ModeMemory) -> dict[str, Any]:
    return {
        "precision": r.label, "model_states": r.states.as_dict(), "activations": r.activations,
        "estimate": r.estimate, "measured_peak": r.peak.bytes, "measured_source": r.peak.source,
        "measured_breakdown": r.peak.breakdown, "peak_reserved": r.peak.reserved, "step_time_ms": r.step_time_ms,
        "batch_size": r.batch_size,
        "activations_per_sample": None if r.activation_line is None else r.activation_line.per_sample,
        "activations_fixed": None if r.activation_line is None else r.activation_line.fixed,
        "batch_estimate": r.batch_estimate, "batch_found": r.batch_found, "search": r.search_log,
        "emulated": r.emulated, "parts": [part.as_dict() for part in r.parts],
    }


def _from_record(m: dict[str, Any]) -> ModeMemory:
    states = {k: v for k, v in m["model_states"].items() if k != "total"}
    line = (None if m.get("activations_per_sample") is None
            else ActivationLine(m["activations_fixed"], m["activations_per_sample"]))
    peak = MeasuredPeak(m["measured_peak"], m["measured_source"], m.get("measured_breakdown") or {},
                        m.get("peak_reserved"))
    return ModeMemory(m["precision"], ModelStateBytes(**states), m["activations"], peak, m["step_time_ms"],
                      m["batch_size"], line, m["batch_estimate"], m["batch_found"], m.get("search") or [],
                      m.get("emulated", False), [ModelPart.from_dict(part) for part in m.get("parts", [])])
