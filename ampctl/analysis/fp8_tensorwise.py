"""`ampctl inspect` against FP8 as torchao's default recipe scales it ("tensorwise": one scale per tensor from
its own amax, this step): per nn.Linear and operand, the share of values that scale flushes to zero (non-zero,
quantized to zero) and saturates (beyond the format's max: none, by construction, unless the amax is not the
tensor's own). The operands are the ones the FP8 matmuls take: the layer's input and weight in E4M3, the
gradient of its output in E5M2 (fp8_emulated.quantize and scale_from_amax: torchao's rules, bit for bit).
Counted on the device while an inspection runs: on the layers an FP8 mode converted (torchao's Float8Linear,
Fp8EmulatedLinear) where it converted some, else on every plain nn.Linear (fp32, bf16, ...). The evidence
`ampctl advise` turns into per-layer rules for precision=fp8."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn

from ampctl.analysis.block_scales import operand_table
from ampctl.analysis.numerics import FormatRange
from ampctl.engine.precision.fp8_emulated import E4M3, E5M2, quantize, scale_from_amax
from ampctl.reports import tables

TITLE = "fp8 tensorwise per Linear: values flushed to zero and saturated by one scale per tensor"
FORMAT = "fp8 tensorwise (e4m3, grads e5m2)"
NOTE = ("fractions of each operand's values over the steps inspected, each tensor scaled by its own amax as "
        "torchao's tensorwise recipe does (E4M3 input and weight, E5M2 output gradient): →0, non-zero and quantized "
        "to zero; sat., beyond the format's max (none when the amax is the tensor's own).")


def fp8_linear_classes() -> tuple[type, ...]:
    """The Linear classes FP8 modes convert to: torchao's only where torchao is already imported (a model holds
    none otherwise)."""
    from ampctl.engine.precision.fp8_emulated import Fp8EmulatedLinear

    torchao_linear = sys.modules.get("torchao.float8.float8_linear")
    return (Fp8EmulatedLinear, *([torchao_linear.Float8Linear] if torchao_linear is not None else []))


def tensorwise_outcomes(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[values, saturated, flushed] of one tensorwise FP8 cast, counted on the device (a long tensor)."""
    x = values.detach().float()
    scale = scale_from_amax(x.abs().max(), dtype)
    quantized = quantize(x, dtype, scale)
    # beyond the rounding boundary above max (a scale rounded up to fp32 puts the amax itself a hair above max,
    # which the cast rounds to max: not saturated)
    saturated = ((x * scale).abs() >= FormatRange.of(str(dtype), dtype).overflow_from).sum()
    flushed = ((x != 0) & (quantized == 0)).sum()
    return torch.stack([torch.tensor(x.numel(), device=x.device), saturated, flushed])


class TensorwiseFp8Recorder:
    """Hooks on every plain nn.Linear (its input and weight in the forward, its output's gradient in the
    backward), added on entry and removed on exit; counts accumulated on the device, read once by table()."""

    def __init__(self, model: nn.Module) -> None:
        converted = [(name, m) for name, m in model.named_modules() if isinstance(m, fp8_linear_classes())]
        self.layers = converted or [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
        self.counts: dict[tuple[str, str], torch.Tensor] = {}
        self._handles: list[Any] = []

    def _add(self, name: str, role: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        counts = tensorwise_outcomes(tensor, dtype)
        key = (name, role)
        self.counts[key] = self.counts[key] + counts if key in self.counts else counts

    def __enter__(self) -> "TensorwiseFp8Recorder":
        if E4M3 is None or E5M2 is None:  # a torch without float8 dtypes: nothing to measure against
            return self
        for name, layer in self.layers:
            def on_forward(module: nn.Linear, args: tuple, output: torch.Tensor, name: str = name) -> None:
                self._add(name, "activation", args[0], E4M3)
                self._add(name, "weight", module.weight, E4M3)
                if output.requires_grad:
                    output.register_hook(lambda grad: self._add(name, "gradient", grad, E5M2))

            self._handles.append(layer.register_forward_hook(on_forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def table(self) -> Optional[tables.ReportTable]:
        if not self.counts:
            return None
        host = dict(zip(self.counts, torch.stack(list(self.counts.values())).cpu().tolist()))  # one transfer
        return operand_table(TITLE, [(name, FORMAT) for name, _ in self.layers], host, NOTE)



def worst_line(table: tables.ReportTable) -> str:
    """The table in one line: the operand FP8's tensorwise scale loses most of (its full table: report.md)."""
    worst = max(((row[0], column, row[i]) for row in table.rows for i, column in enumerate(table.columns)
                 if i >= 2 and row[i] is not None), key=lambda item: item[2], default=None)
    if worst is None:
        return "fp8 tensorwise: no Linear operand recorded"
    layer, column, share = worst
    role, what = column.rsplit("_", 1)
    return (f"fp8 tensorwise (torchao's default scaling) of {len(table.rows)} Linear layers: at most "
            f"{tables.fraction_cell(share)} of an operand {'flushed to zero' if what == 'flushed' else 'saturated'} "
            f"(the {role}s of layer {layer}); per layer in report.md and ranges.json")
