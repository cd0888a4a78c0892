"""Block-scaled layers (MXFP8, MXFP4, NVFP4, by mode or by rule) observed as each operand is quantized: the
activations and the weight as the forward matmul takes them, the output gradient as the input-gradient matmul takes
it. `ampctl inspect` counts, per layer and operand, the share of values its block's scale saturates (beyond the
element's max after the scale: clipped) or flushes (non-zero, quantized to zero), on the device; telemetry.blocks_every
records those and the block scales' own figures every N steps of `ampctl train` (BlocksLog). And the resolved
precision of every layer, the table the start lines print."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ampctl.engine.precision.block_quantize import BLOCK_STATS, BlockFormat, block_outcomes, block_stats
from ampctl.engine.precision.layers import LayerRow, display_name, legend
from ampctl.engine.precision.mx_emulated import block_scaled_layers
from ampctl.reports import tables
from ampctl.reports.tables import fraction_cell

ROLES = ("activation", "weight", "gradient")
BLOCKS_TITLE = "block scales per layer: values saturated (clipped at the element's max) and flushed to zero"
PRECISION_TITLE = "resolved precision per layer"
PRECISION_COLUMNS = ["layer", "type", "compute", "weights", "converter", "rule"]


class BlockScaleRecorder:
    """Observers on every block-scaled layer (an MXLinear; grouped experts: all their experts' GEMMs as one layer),
    added on entry and removed on exit: [values, saturated, flushed] per layer and operand, accumulated on the device
    (read once, by table())."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = block_scaled_layers(model)
        self.counts: dict[tuple[str, str], torch.Tensor] = {}
        self._observers: list[tuple[Any, Any]] = []

    def __enter__(self) -> "BlockScaleRecorder":
        for name, layer in self.layers:
            def observe(role: str, matrix: torch.Tensor, fmt: BlockFormat, name: str = name) -> None:
                counts = block_outcomes(matrix, fmt)
                key = (name, role)
                self.counts[key] = self.counts[key] + counts if key in self.counts else counts

            layer.observers.append(observe)
            self._observers.append((layer, observe))
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, observe in self._observers:
            layer.observers.remove(observe)
        self._observers.clear()

    def table(self) -> Optional[tables.ReportTable]:
        if not self.counts:
            return None
        host = dict(zip(self.counts, torch.stack(list(self.counts.values())).cpu().tolist()))  # one transfer
        return operand_table(BLOCKS_TITLE, [(name, layer.fmt) for name, layer in self.layers], host, BLOCKS_NOTE)


class BlocksLog:
    """telemetry.blocks_every=N during `ampctl train`: on every N-th step, observers on every block-scaled layer for
    that step alone (its micro-batches summed); afterwards one line to blocks.jsonl, every figure read in one
    transfer, and the same to `written` (the trackers). Per layer and operand (the activations and the weight as the
    forward quantizes them, the output gradient as the input gradient's GEMM does): the shares of values saturated
    and flushed to zero, of blocks whose scale its format clipped or raised, the relative RMS quantization error and
    the largest scale's headroom (log2). The other steps run without observers."""

    def __init__(self, model: nn.Module, every: int, path: Path, written: Callable[[dict[str, Any]], None]) -> None:
        self._layers = block_scaled_layers(model)
        self._every, self._path, self._written = every, path, written

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step % self._every or not self._layers:
            yield
            return
        sums: dict[tuple[str, str], torch.Tensor] = {}
        observers = []
        for name, layer in self._layers:
            def observe(role: str, matrix: torch.Tensor, fmt: BlockFormat, name: str = name) -> None:
                figures = block_stats(matrix, fmt)
                key = (name, role)
                if key in sums:  # a sum over micro-batches; the headroom is the least of theirs
                    figures = torch.cat([sums[key][:-1] + figures[:-1], torch.minimum(sums[key][-1:], figures[-1:])])
                sums[key] = figures

            layer.observers.append(observe)
            observers.append((layer, observe))
        try:
            yield
        finally:
            for layer, observe in observers:
                layer.observers.remove(observe)
        if not sums:
            return
        host = dict(zip(sums, torch.stack(list(sums.values())).cpu().tolist()))  # one transfer
        row: dict[str, Any] = {"step": step, "layers": {}}
        for name, layer in self._layers:
            operands = {role: shares(dict(zip(BLOCK_STATS, host[(name, role)]))) for role in ROLES
                        if (name, role) in host}
            row["layers"][name] = {"format": layer.fmt, **operands}
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self._written(row)


def shares(figures: dict[str, float]) -> dict[str, Any]:
    """block_stats' sums as a blocks.jsonl operand: counts as shares, the error as a relative RMS."""
    values, blocks = figures["values"], figures["blocks"]
    error = (figures["error_sq"] / figures["value_sq"]) ** 0.5 if figures["value_sq"] > 0 else 0.0
    return {"values": int(values), "saturated": figures["saturated"] / values, "flushed": figures["flushed"] / values,
            "blocks": int(blocks), "scale_clipped": figures["scale_saturated"] / blocks,
            "scale_raised": figures["scale_underflow"] / blocks, "error": error,
            "scale_headroom_log2": figures["scale_headroom_log2"]}


BLOCKS_NOTE = ("fractions of each operand's values over the steps inspected: sat., beyond the element's max after its "
               "block's scale (clipped to it); →0, non-zero and quantized to zero. Activations and weights as the "
               "forward matmul quantizes them (blocks along K), gradients as the input-gradient matmul does (along N). "
               "Emulated: the numerics are the format's, the speed is not.")
OPERAND_COLUMNS = ["layer", "format", *(f"{role}_{what}" for role in ROLES for what in ("saturated", "flushed"))]


def operand_table(title: str, layers: list[tuple[str, Any]], host: dict[tuple[str, str], list[int]],
                  note: str) -> tables.ReportTable:
    """One row per layer: the share of each operand's values saturated and flushed, from host counts
    [values, saturated, flushed] by (layer, role)."""
    rows = []
    for name, fmt in layers:
        row: list[Any] = [name, fmt]
        for role in ROLES:
            values, saturated, flushed = host.get((name, role), (0, 0, 0))
            row += [saturated / values, flushed / values] if values else [None, None]
        rows.append(row)
    return styled_operands(title, OPERAND_COLUMNS, rows, note)


def styled_operands(title: str, columns: list[str], rows: list[list[Any]], note: str) -> tables.ReportTable:
    headers = {c: c.replace("activation_", "act ").replace("weight_", "weight ").replace("gradient_", "grad ")
               .replace("saturated", "sat.").replace("flushed", "→0") for c in columns}
    formats = {c: lambda v: "-" if v is None else fraction_cell(v) for c in columns[2:]}
    return tables.ReportTable(title, columns, rows, notes=[note], headers=headers, formats=formats)


def styled_blocks(columns: list[str], rows: list[list[Any]]) -> tables.ReportTable:
    return styled_operands(BLOCKS_TITLE, columns, rows, BLOCKS_NOTE)


def precision_table(rows: list[LayerRow]) -> tables.ReportTable:
    """The resolved precision of every layer (layers.table), as a report table."""
    return tables.ReportTable(PRECISION_TITLE, PRECISION_COLUMNS,
                              [[display_name(r), r.type, r.compute, r.weights, r.converter, r.rule] for r in rows],
                              notes=legend(r.compute for r in rows))

