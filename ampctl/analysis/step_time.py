"""Where a step's time goes, from a torch.profiler window of steady steps: the one-screen summary of
`train.profile=N` (the trace itself is for Perfetto or TensorBoard).

Every microsecond of the window is put in exactly one category, so the categories add up to the step time:
- on a CPU, each op's self time (torch's own exclusive time of an op, less the ops it called); time inside the
  steps that no op accounts for is the loop's Python, autograd's engine and torch's dispatch ("framework");
- on a GPU, each kernel's time on the device, attributed through the op that launched it; the rest of the
  window is time the device sat idle (waiting on the host: launch overhead, a sync, data).
A kernel or op launched inside the data fetch (loop.DATA_RANGE) or torch.optim's own ranges (Optimizer.step,
Optimizer.zero_grad) counts as data or optimizer whatever it is; the others count by what they compute.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ampctl.engine.loop import DATA_RANGE

MATMUL, ATTENTION, OTHER_OPS = "matmul & conv", "attention", "elementwise & other ops"
COPIES, COMMUNICATION, OPTIMIZER, DATA = "memory copies", "communication", "optimizer", "data"
FRAMEWORK, DEVICE_IDLE = "framework & Python", "device idle"

# op or kernel names, tried in this order (a flash-attention kernel is attention, not a GEMM)
_BY_NAME = (
    (COMMUNICATION, re.compile(r"nccl|gloo|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter"
                               r"|broadcast|all_to_all", re.I)),
    (ATTENTION, re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn_attention|attention", re.I)),
    (MATMUL, re.compile(r"^aten::(_?(add)?b?mm|baddbmm|addbmm|matmul|linear|_int_mm|_scaled_mm\w*|_scaled_grouped_mm"
                        r"|\w*conv\w*)$|gemm|cutlass|xmma|nvjet|wgmma|cublas|triton_tem_fused_\w*mm|mkldnn_\w*"
                        r"(linear|matmul|conv)|conv(olution)?", re.I)),
    (COPIES, re.compile(r"^(Memcpy|Memset)|^aten::(copy_|_to_copy|to|contiguous|clone)$", re.I)),
)
# the ranges torch.optim opens around every step() and zero_grad()
_OPTIMIZER_RANGE = re.compile(r"^Optimizer\.(step|zero_grad)#")
# events that are not ops: the profiler's step marks, autograd's engine and nodes, compiled-graph ranges,
# user ranges. Their self time is host overhead, not computation.
_NOT_AN_OP = re.compile(r"^(ProfilerStep[#*]|autograd::|torch::autograd::|Optimizer\.|ampctl\.|##|Torch-Compiled"
                        r"|CompiledFunction|TorchDynamo|cuda(Launch|Memcpy|Memset|StreamSynchronize|DeviceSynchronize|EventRecord"
                        r"|GetDevice|Func)|cu(Launch|Memcpy|Ctx))|Backward\d*$|^detach_?$")


def op_category(name: str) -> str:
    """What an op or kernel computes, by its name."""
    for category, pattern in _BY_NAME:
        if pattern.search(name):
            return category
    return OTHER_OPS


@dataclass
class TopEntry:
    name: str
    ms_per_step: float
    calls_per_step: float
    category: str


@dataclass
class StepBreakdown:
    device_type: str  # "cpu" | "cuda"
    steps: int  # steps in the window
    step_ms: float  # wall time of a step (CPU) or device time from its first kernel to its last (GPU)
    ms_per_step: dict[str, float]  # category -> ms per step; the values add up to step_ms
    top: list[TopEntry] = field(default_factory=list)  # ops (CPU) or kernels (GPU) by time, largest first
    data_host_ms: float = 0.0  # host time a step waited for its batches (the same as DATA on a CPU)

    def as_dict(self) -> dict:
        return {
            "device_type": self.device_type,
            "steps": self.steps,
            "step_ms": round(self.step_ms, 3),
            "ms_per_step": {k: round(v, 3) for k, v in self.ms_per_step.items()},
            "data_host_ms_per_step": round(self.data_host_ms, 3),
            "top": [{"name": t.name, "ms_per_step": round(t.ms_per_step, 3),
                     "calls_per_step": round(t.calls_per_step, 2), "category": t.category} for t in self.top],
        }


def _phase(event: Any) -> Optional[str]:
    """DATA or OPTIMIZER when the event runs inside one of those ranges (on its own thread), else None."""
    while event is not None:
        if event.name == DATA_RANGE:
            return DATA
        if _OPTIMIZER_RANGE.match(event.name):
            return OPTIMIZER
        event = event.cpu_parent
    return None


def _span_us(events: Iterable[Any]) -> float:
    return sum(e.time_range.end - e.time_range.start for e in events)


def breakdown(events: list[Any], device_type: str, top_n: int = 10) -> StepBreakdown:
    """The breakdown of a profiler window from its FunctionEvents (`prof.events()`), one ProfilerStep#N range
    per step (torch.profiler's schedule marks them)."""
    # named ProfilerStep#N in the trace, ProfilerStep* in the events
    step_marks = [e for e in events if e.name.startswith("ProfilerStep") and e.device_type.name == "CPU"]
    steps = max(1, len(step_marks))
    host_ops = [e for e in events if e.device_type.name == "CPU" and not e.is_async]
    data_host_us = _span_us(e for e in host_ops if e.name == DATA_RANGE)
    totals: dict[str, float] = defaultdict(float)  # category -> us in the window
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])  # (name, category) -> [us, calls]

    def add(name: str, category: str, us: float) -> None:
        totals[category] += us
        by_name[name, category][0] += us
        by_name[name, category][1] += 1

    if device_type == "cuda":
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        if kernels:
            window_us = max(k.time_range.end for k in kernels) - min(k.time_range.start for k in kernels)
        else:
            window_us = _span_us(step_marks)
        for op in host_ops:
            phase = _phase(op)
            for kernel in op.kernels:
                add(kernel.name, phase or _kernel_category(op.name, kernel.name), kernel.duration)
        idle = DEVICE_IDLE
    else:
        window_us = _span_us(step_marks)
        for op in host_ops:
            phase = _phase(op)  # inside the data fetch or the optimizer, all of it is theirs
            if phase is None and _NOT_AN_OP.search(op.name):
                continue  # host overhead: in FRAMEWORK, the remainder below
            add(op.name, phase or op_category(op.name), op.self_cpu_time_total)
        idle = FRAMEWORK
    totals[idle] = max(0.0, window_us - sum(totals.values()))
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:top_n]
    return StepBreakdown(
        device_type=device_type,
        steps=steps,
        step_ms=window_us / steps / 1e3,
        ms_per_step={category: us / steps / 1e3 for category, us in
                     sorted(totals.items(), key=lambda item: -item[1]) if us > 0},
        top=[TopEntry(name, us / steps / 1e3, calls / steps, category) for (name, category), (us, calls) in top],
        data_host_ms=data_host_us / steps / 1e3,
    )


def _kernel_category(op_name: str, kernel_name: str) -> str:
    """A GPU kernel's category: its launching op's when that op says (aten::mm launches GEMMs whatever their
    kernels are called), else the kernel's own name (a compiled graph launches Triton kernels)."""
    by_op = op_category(op_name) if op_name else OTHER_OPS
    return by_op if by_op != OTHER_OPS else op_category(kernel_name)


def render(result: StepBreakdown, first_step: int, trace: str) -> list[str]:
    """The one-screen summary."""
    what = "device time" if result.device_type == "cuda" else "CPU time"
    lines = [f"profile of steps {first_step}-{first_step + result.steps - 1} ({result.steps} steady steps, "
             f"{result.step_ms:.2f} ms a step, {what}): trace {trace} (open in https://ui.perfetto.dev or "
             "TensorBoard)"]
    for category, ms in result.ms_per_step.items():
        share = ms / result.step_ms if result.step_ms else 0.0
        lines.append(f"  {category:<24} {ms:10.3f} ms  {share:6.1%}")
    if result.device_type == "cuda" and result.data_host_ms:
        lines.append(f"  (the host waited {result.data_host_ms:.3f} ms a step for batches)")
    lines.append(f"  top {'kernels' if result.device_type == 'cuda' else 'ops'} by {what}, a step:")
    for entry in result.top:  # the figures first, the name after: a line an 80-column terminal holds
        calls = entry.calls_per_step
        count = f"{calls:.0f}" if abs(calls - round(calls)) < 0.05 else f"{calls:.1f}"  # 35 calls, not 35.0
        name = entry.name if len(entry.name) <= 60 else entry.name[:57] + "..."
        lines.append(f"    {entry.ms_per_step:9.3f} ms {count:>5}x  {name} ({entry.category})")
    return lines
