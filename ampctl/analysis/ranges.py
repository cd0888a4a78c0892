"""Value ranges, recorded: log2-magnitude histograms of a model's activations (module outputs), activation
gradients, weight gradients and weights, on the device, by hooks that exist only while a RangeRecorder is
entered. `ampctl inspect` records its steps with one (studies/inspect_ranges.py); `ampctl train` with
telemetry.ranges_every=N records every N-th step with a RangesLog. Gradients are recorded as true values
(divided by the loss scale their step used). Grouped experts (engine/precision/grouped_experts.py) are recorded per
expert, as rows `<layer>[e]`: each expert's slice of the weights and their gradients, and its rows of the output
and of the output's gradient."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ampctl import io
from ampctl.analysis.numerics import FORMATS, FP16, RangeStats
from ampctl.engine.precision.grouped_experts import expert_rows, is_grouped_experts
from ampctl.errors import UsageError

KINDS = ("activation", "activation_grad", "weight_grad", "weight")
GRADIENT_KINDS = ("activation_grad", "weight_grad")


def expert_row(layer: str, expert: int) -> str:
    """The row of one expert of a grouped experts layer."""
    return f"{layer}[{expert}]"


def split_row(row: str) -> tuple[str, int]:
    """(the layer, its expert; -1 for a whole layer's row)."""
    layer, _, expert = row.partition("[")
    return layer, int(expert[:-1]) if expert else -1


def power_of_two_log2(value: float, key: str) -> int:
    exponent = math.log2(value) if value > 0 else float("nan")
    if not math.isfinite(exponent) or exponent != int(exponent):
        raise UsageError(f"{key}={value:g} is not allowed: expected a power of two (e.g. 65536), so that "
                         "scaling shifts magnitudes exactly")
    return int(exponent)


class RangeRecorder:
    """Forward hooks on every leaf module (and a gradient hook on each output, and on each parameter):
    registered on entry, removed on exit. Gradients arrive multiplied by the loss scale of their step
    (run_scale) and are recorded as their true values, divided out in float64 (see numerics). Grouped experts are
    recorded per expert: their output's rows split by the tokens each expert got (read on the host: a sync per
    experts layer on the recorded steps only), their weights and weight gradients along the experts' dimension."""

    def __init__(self, model: nn.Module, device: torch.device, study_scale: float) -> None:
        self.layers = [(name or "model", m) for name, m in model.named_modules() if not list(m.children())]
        self.stats: dict[tuple[str, str], RangeStats] = {}
        self._device, self._study = device, study_scale
        self._handles: list[Any] = []
        self.run_scale = 1.0  # the loss scale of the step being recorded

    def _stats(self, layer: str, kind: str) -> RangeStats:
        key = (layer, kind)
        if key not in self.stats:
            self.stats[key] = RangeStats(self._device, self._study if kind in GRADIENT_KINDS else 1.0)
        return self.stats[key]

    def _add(self, layer: str, kind: str, tensor: torch.Tensor, experts: bool, sizes: Any = None) -> None:
        """tensor's values into the layer's row; a grouped experts layer's into each expert's row, split along the
        experts' dimension (a weight's) or into the rows of each expert (sizes: an output's)."""
        divided_by = self.run_scale if kind in GRADIENT_KINDS else 1.0
        if not experts:
            self._stats(layer, kind).add(tensor, divided_by=divided_by)
            return
        parts = tensor.split(sizes) if sizes is not None else tensor.unbind(0)
        for expert, part in enumerate(parts):
            self._stats(expert_row(layer, expert), kind).add(part, divided_by=divided_by)

    def _on_output(self, layer: str, args: tuple, output: Any, experts: bool) -> None:
        sizes = expert_rows(args, output) if experts else None
        for tensor in io.tensors_in(output):
            if not tensor.is_floating_point():
                continue
            self._add(layer, "activation", tensor, sizes is not None, sizes)
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, layer=layer, sizes=sizes: self._add(
                    layer, "activation_grad", grad, sizes is not None, sizes))

    def __enter__(self) -> "RangeRecorder":
        seen: set[int] = set()
        for layer, module in self.layers:
            experts = is_grouped_experts(module)
            self._handles.append(module.register_forward_hook(
                lambda _m, args, output, layer=layer, experts=experts: self._on_output(layer, args, output, experts)))
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen or not param.requires_grad:
                    continue  # a tied weight is recorded once, under its first layer
                seen.add(id(param))
                self._handles.append(param.register_post_accumulate_grad_hook(
                    lambda p, layer=layer, experts=experts: self._add(layer, "weight_grad", p.grad, experts)))
        return self

    def record_weights(self) -> None:
        seen: set[int] = set()
        for layer, module in self.layers:
            for param in module.parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    self._add(layer, "weight", param.detach(), is_grouped_experts(module))

    def types(self) -> dict[str, str]:
        """Each recorded row's module type (an expert's row: its layer's)."""
        of_layer = {name: type(module).__name__ for name, module in self.layers}
        return {row: of_layer[split_row(row)[0]] for row, _ in self.stats}

    def order(self, row: str) -> tuple[int, int]:
        """Where a row goes: in the model's order of leaf modules, a layer's experts in their order."""
        layer, expert = split_row(row)
        return self._position[layer], expert

    @functools.cached_property
    def _position(self) -> dict[str, int]:
        return {name: i for i, (name, _) in enumerate(self.layers)}

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RangesLog:
    """telemetry.ranges_every=N during `ampctl train`: on every N-th step, the range hooks are on for that
    step alone, and afterwards one line of per-layer fractions goes to ranges.jsonl (two host reads, the
    loss scale before the step and every counter in one transfer after it, on those steps only). The other
    steps run without hooks."""

    def __init__(self, model: nn.Module, scaler: Any, device: torch.device, every: int, path: Path) -> None:
        self._model, self._scaler, self._device, self._every, self._path = model, scaler, device, every, path

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step % self._every:
            yield
            return
        run_scale = float(self._scaler.current_scale())
        recorder = RangeRecorder(self._model, self._device, study_scale=run_scale)  # where this step's fell
        recorder.run_scale = run_scale
        with recorder:
            recorder.record_weights()
            yield
        layers: dict[str, dict[str, Any]] = {}
        for (layer, kind), stats in zip(recorder.stats, RangeStats.on_host(list(recorder.stats.values()))):
            entry = {"max_abs": float(stats.max_abs)}
            for f in FORMATS:
                for what, fraction in stats.fractions(f, scaled=False).items():
                    entry[f"{f.name}_{what}"] = fraction
            if kind in GRADIENT_KINDS:  # where the scaled gradients of this step fell in fp16
                for what, fraction in stats.fractions(FP16, scaled=True).items():
                    entry[f"fp16_{what}_scaled"] = fraction
            layers.setdefault(layer, {})[kind] = entry
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "loss_scale": run_scale, "layers": layers}) + "\n")
