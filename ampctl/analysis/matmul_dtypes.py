"""Which precision the matmuls of a profiled window actually ran in: their FLOPs and time by operand dtype, read
from torch.profiler's events (recorded with their input shapes and dtypes), so that a mode's name is checked
against what ran (FP8 flags that ran bf16 GEMMs, LlamaFactory#9500; NVFP4 flags that ran no NVFP4 kernel,
Megatron-LM#3423). The GEMM ops counted: aten::mm, addmm, bmm, baddbmm, _scaled_mm and _int_mm, each once: a scaled
GEMM as itself (not the tensor subclass's mm around it, in its nominal dtype, nor a CPU reference kernel's fp32
matmul inside it), any other the outermost; the model's (not a recipe's own inside the data fetch); a convolution's
FLOPs are not among them. FLOPs are 2·M·N·K a product (per
batch for the batched ones); the dtype is the first matrix operand's."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from ampctl.engine.loop import DATA_RANGE

LAYER_RANGE = "ampctl.layer:"  # a leaf layer's forward, in the profiled window (LayerRanges)
# the compute a layer's plan names (engine/precision/layers.LayerRow.compute) -> the operand dtype its matmuls take
EXPECTED = {"float32": "float32", "tf32": "float32", "bfloat16": "bfloat16", "float16": "float16",
            "fp8": "float8_e4m3fn"}
# op -> (index of the first matrix operand, of the second) in its inputs
GEMMS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
         "aten::_scaled_mm": (0, 1), "aten::_int_mm": (0, 1)}
_DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16", "double": "float64",
           "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2", "signed char": "int8",
           "c10::Float4_e2m1fn_x2": "float4_e2m1fn_x2"}


@dataclass
class MatmulDtypes:
    """Per step of the window: the matmul FLOPs and milliseconds by operand dtype, and the calls by op."""

    steps: int
    flops: dict[str, float] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)  # op -> calls a step
    # each layer's forward matmuls (the backward's run in autograd's engine, outside the layers' ranges): dtype ->
    # FLOPs a step
    by_layer: dict[str, dict[str, float]] = field(default_factory=dict)
    # the layers whose forward matmuls ran otherwise than their plan meant: layer -> (meant, ran)
    otherwise: dict[str, tuple[str, str]] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        total = sum(self.flops.values())
        return {dtype: f / total for dtype, f in sorted(self.flops.items(), key=lambda item: -item[1])} if total \
            else {}

    def lines(self) -> list[str]:
        """`matmul precision: 97.0% of FLOPs in bfloat16, 3.0% in float32 (float32: 9 by rule) ...`, and a warning
        naming the layers that ran otherwise than the mode meant; none without a matmul in the window."""
        shares = self.shares()
        if not shares:
            return []
        parts = [f"{share:.1%} {'of FLOPs ' if i == 0 else ''}in {dtype}{self._whose(dtype)}"
                 for i, (dtype, share) in enumerate(shares.items())]
        lines = [f"matmul precision: {', '.join(parts)} (what ran in the profiled steps: "
                 f"{', '.join(f'{op} x{n:g}' for op, n in sorted(self.calls.items()))} a step)"]
        if self.otherwise:
            named = ", ".join(f"{layer} (meant {meant}, ran {ran})" for layer, (meant, ran) in self.otherwise.items())
            lines.append(f"warning: layers whose matmuls ran otherwise than the mode meant: {named}")
        return lines

    def _whose(self, dtype: str) -> str:
        """` (9, 4)`: the layers whose forward ran in dtype, where they are a minority of those measured."""
        layers = [layer for layer, flops in self.by_layer.items() if max(flops, key=flops.get) == dtype]
        return f" ({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''})" \
            if layers and len(layers) < len(self.by_layer) / 2 else ""

    def as_dict(self) -> dict[str, Any]:
        return {"flops_per_step": {k: round(v) for k, v in self.flops.items()},
                "ms_per_step": {k: round(v, 3) for k, v in self.ms.items()},
                "shares": {k: round(v, 6) for k, v in self.shares().items()},
                "calls_per_step": {k: round(v, 2) for k, v in self.calls.items()},
                "forward_by_layer": {layer: {k: round(v) for k, v in flops.items()}
                                     for layer, flops in self.by_layer.items()},
                "ran_otherwise": {layer: {"meant": meant, "ran": ran}
                                  for layer, (meant, ran) in self.otherwise.items()}}


def gemm_flops(name: str, shapes: list[list[int]]) -> Optional[float]:
    """2·M·N·K (times the batch) of one GEMM op from its input shapes; None where they are not a GEMM's."""
    a_at, b_at = GEMMS[name]
    if len(shapes) <= max(a_at, b_at):
        return None
    a, b = shapes[a_at], shapes[b_at]
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return None


class LayerRanges:
    """Each leaf layer's forward inside a profiler range of its name (attached for the profiled window only: a hook
    a layer costs every step), so that a forward matmul is the layer's that ran it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []

    def attach(self) -> None:
        if self._handles:
            return
        for name, module in self.model.named_modules():
            if name and next(module.children(), None) is None:
                opened: list[Any] = []
                self._handles.append(module.register_forward_pre_hook(self._open(name, opened)))
                self._handles.append(module.register_forward_hook(self._close(opened)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _open(name: str, opened: list[Any]) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            opened.append(torch.profiler.record_function(LAYER_RANGE + name).__enter__())
        return hook

    @staticmethod
    def _close(opened: list[Any]) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            if opened:
                opened.pop().__exit__(None, None, None)
        return hook


def _layer_of(event: Any) -> Optional[str]:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(LAYER_RANGE):
            return parent.name[len(LAYER_RANGE):]
        parent = parent.cpu_parent
    return None


def _otherwise(by_layer: dict[str, dict[str, float]], layer_rows: list[Any]) -> dict[str, tuple[str, str]]:
    """The layers whose forward matmuls ran mostly in another dtype than their plan's compute (an emulated format,
    whose arithmetic is not its format's, and a compute the plan cannot name a dtype for are not judged)."""
    meant = {name: EXPECTED.get(row.compute.split(" ")[0]) for row in layer_rows for name in (row.names or [row.layer])
             if "emulated" not in row.compute}
    out = {}
    for layer, flops in by_layer.items():
        ran = max(flops, key=flops.get)
        if meant.get(layer) is not None and ran != meant[layer]:
            out[layer] = (meant[layer], ran)
    return out


SCALED = ("aten::_scaled_mm", "aten::_int_mm")  # the low-precision GEMMs: counted whatever they run inside


def _not_the_models(event: Any) -> bool:
    """Not counted: a GEMM inside another (a CPU _scaled_mm's fp32 reference matmul; an op inside a counted one), one
    around a scaled GEMM (a tensor subclass's aten::mm in its nominal dtype, which runs torchao's _scaled_mm), and
    one inside the data fetch (a recipe's own arithmetic on its batches, not the model's)."""
    outer = SCALED if event.name in SCALED else GEMMS  # a scaled GEMM counts inside the subclass's mm around it
    if event.name not in SCALED:
        stack = list(event.cpu_children)
        while stack:
            child = stack.pop()
            if child.name in SCALED:
                return True
            stack.extend(child.cpu_children)
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == DATA_RANGE or parent.name in outer:
            return True
        parent = parent.cpu_parent
    return False


def matmul_dtypes(events: list[Any], steps: int, layer_rows: Optional[list[Any]] = None) -> MatmulDtypes:
    """The window's GEMMs (FunctionEvents recorded with record_shapes=True), per step, and by the layer whose forward
    ran them (LayerRanges) against what its plan meant (layer_rows). Time: the op's own CPU time on a CPU, its
    kernels' device time on a GPU."""
    by_layer: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    flops: dict[str, float] = defaultdict(float)
    us: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name not in GEMMS or e.device_type.name != "CPU" or _not_the_models(e):
            continue
        count = gemm_flops(e.name, list(e.input_shapes or []))
        dtypes = list(getattr(e, "input_dtypes", None) or [])
        if count is None or len(dtypes) <= GEMMS[e.name][0]:
            continue
        dtype = _DTYPES.get(dtypes[GEMMS[e.name][0]], dtypes[GEMMS[e.name][0]])
        flops[dtype] += count
        layer = _layer_of(e)
        if layer is not None:
            by_layer[layer][dtype] += count / max(steps, 1)
        device_us = sum(k.duration for k in e.kernels)
        us[dtype] += device_us if device_us else e.cpu_time_total
        calls[e.name.removeprefix("aten::")] += 1
    steps = max(steps, 1)
    layers = {layer: dict(f) for layer, f in by_layer.items()}
    return MatmulDtypes(steps, {k: v / steps for k, v in flops.items()}, {k: v / steps / 1e3 for k, v in us.items()},
                        {k: v / steps for k, v in calls.items()}, layers, _otherwise(layers, layer_rows or []))
