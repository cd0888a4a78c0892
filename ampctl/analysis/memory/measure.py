"""The measured peak of a few training steps, from model build to the last optimizer step.

CUDA: torch.cuda.max_memory_allocated, the caching allocator's high-water mark of tensor memory (its
reserve, the CUDA context and library workspaces are outside it; the reserve is reported beside it).
CPU: torch's memory profiler (profile_memory=True), which sees every allocation and free
of torch's CPU allocator: the peak is the highest running sum of them. `ampctl memory` asks for a breakdown by
category too (parameters, optimizer state, gradients, activations, temporaries...), for which torch's memory
timeline needs every op's shapes and Python stack and a data-flow analysis of the whole window: a minute on a
small transformers model, where the sum alone costs nothing measurable. The
process's max RSS would include the interpreter and torch's own code, hundreds of MiB.

`ampctl memory`, `ampctl train` and `ampctl compare` report this one definition: tensor memory held by
torch's allocator. A training run (TrainingPeak) measures it over its whole length on CUDA, where reading the
allocator's high-water mark costs nothing, and on a CPU over the model build and its first MEASURED_STEPS
steps, the steps `ampctl memory` measures by default: profiling every step would slow the run, and a step
after the second repeats the second's allocations.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import tempfile
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

# The order of the categories in torch's memory timeline (torch.profiler._memory_profiler's
# _CATEGORY_TO_INDEX), after its leading total column; None is memory it could not attribute.
MEASURED_STEPS = 2  # on a CPU: the first step allocates the optimizer's states, the second is a steady one
PROFILER_CATEGORIES = ("parameters", "optimizer_state", "inputs", "temporaries", "activations", "gradients",
                       "autograd_detail", "unattributed")


@dataclass
class MeasuredPeak:
    bytes: Optional[int] = None
    source: str = ""
    breakdown: dict[str, int] = field(default_factory=dict)  # category -> bytes at the peak
    reserved: Optional[int] = None  # CUDA: the caching allocator's peak reserve


def cpu_profiler_available() -> bool:
    return hasattr(torch.profiler.profile, "export_memory_timeline")


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@contextmanager
def measure_peak(device: torch.device, by_category: bool = False) -> Iterator[MeasuredPeak]:
    """Measures the peak of what runs inside; the result is filled in on exit. by_category: on a CPU, the
    breakdown at the peak too (torch's memory timeline: slow, see the module docstring)."""
    result = MeasuredPeak()
    release_memory(device)
    if device.type == "cuda":
        # Whatever an earlier measurement left allocated (a cache, an object not yet collected) is not
        # this one's: the peak is counted from what is allocated now.
        baseline = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - baseline
        result.reserved = torch.cuda.max_memory_reserved(device)
        result.source = "torch.cuda.max_memory_allocated"
        return
    if not cpu_profiler_available():
        yield result
        result.source = "not measured: this torch has no memory timeline"
        return
    if by_category:  # the timeline is torch.profiler's
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
    else:
        # the autograd profiler that torch.profiler.profile drives: the same allocation events, without its
        # start, which imports Inductor and Dynamo to read one flag (1-5 s of every CPU run's start here)
        prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
    with quiet_kineto(), _without_stderr_lines(_UNKNOWN_BLOCK), prof:
        yield result
    try:
        result.bytes = _allocation_peak(prof.profiler.kineto_results if by_category else prof.kineto_results)
        if by_category:
            result.breakdown = _timeline_peak(prof)
        result.source = "torch memory profiler (CPU allocator)"
    except Exception as exc:  # noqa: BLE001  torch's timeline analysis is private and has failed on FSDP graphs:
        # an instrument that cannot read a run must not end it
        result.source = f"not measured: torch's memory profiler could not analyse this run ({type(exc).__name__})"


@contextmanager
def quiet_kineto() -> Iterator[None]:
    """Kineto, the profiler's native side, logs its start and stop (and, on a CUDA build without a GPU, a
    device-count error) to stderr; level 6 silences it. Kineto reads the variable when it logs."""
    saved = os.environ.get("KINETO_LOG_LEVEL")
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
        else:
            os.environ["KINETO_LOG_LEVEL"] = saved


# torch's CPU allocator logs this (from C++, straight to stderr) whenever a tensor allocated before the
# profiler started is freed inside it: expected here, since the recipe's data predates the measurement.
_UNKNOWN_BLOCK = re.compile(r"Memory block of unknown size was allocated before the profiling started")


@contextmanager
def _without_stderr_lines(pattern: re.Pattern) -> Iterator[None]:
    """Holds what is written to file descriptor 2 inside (C++ logs included) and passes it on at the end,
    less the lines matching pattern."""
    try:
        saved_fd = os.dup(2)
    except OSError:  # no stderr to redirect
        yield
        return
    with tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not pattern.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class TrainingPeak:
    """The peak memory of a training run (see the module docstring): `with peak.measuring():` around the
    model's build and the training, after_step() after every step. bytes() is None until it is known."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._measurement = ExitStack()
        self._result: Optional[MeasuredPeak] = None
        self._steps = 0
        self._enabled = True
        self._not_measured = "telemetry.profile_cpu_memory=false"

    @contextmanager
    def measuring(self, enabled: bool = True, why_not: str = "") -> Iterator["TrainingPeak"]:
        """Measures from entry (before the model is built) to MEASURED_STEPS steps on a CPU, or to the exit.
        why_not: what the summary says when not enabled."""
        self._enabled = enabled
        self._not_measured = why_not or self._not_measured
        if enabled and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif enabled and cpu_profiler_available():
            self._result = self._measurement.enter_context(measure_peak(self.device))
        with self._measurement:
            yield self

    def after_step(self) -> None:
        self._steps += 1
        if self._steps == MEASURED_STEPS:
            self._measurement.close()  # a CPU measurement fills its result on exit

    @property
    def untimed_steps(self) -> int:
        """Steps whose time the CPU profiler distorts."""
        return MEASURED_STEPS if self._result is not None else 0

    @property
    def source(self) -> str:
        """What measured bytes(), or why nothing did."""
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated"
        if not self._enabled:
            return f"not measured ({self._not_measured})"
        if not cpu_profiler_available():
            return "not measured: this torch has no CPU memory timeline"
        if self._result is not None and self._result.source.startswith("not measured"):
            return self._result.source
        return f"torch memory profiler (CPU allocator), model build and steps 1-{MEASURED_STEPS}"

    def bytes(self) -> Optional[int]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return None if self._result is None else self._result.bytes


def _allocation_peak(kineto_results) -> int:
    """The most tensor memory allocated inside the window and alive at once: the allocator's allocations and
    frees in time order, by address. A block allocated before the window (the recipe's data, a model an earlier
    measurement in this process left) is not counted when it is freed inside: this window did not allocate it."""
    from torch._C._profiler import _EventType

    nodes, allocations = list(kineto_results.experimental_event_tree()), []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            allocations.append(node)
    allocations.sort(key=lambda node: node.start_time_ns)
    sizes: dict[int, int] = {}  # address -> size of the blocks allocated inside the window and still alive
    live = peak = 0
    for node in allocations:
        block = node.extra_fields
        if block.alloc_size > 0:
            sizes[block.ptr] = block.alloc_size
            live += block.alloc_size
            peak = max(peak, live)
        else:
            live -= sizes.pop(block.ptr, 0)
    return peak


def _timeline_peak(prof) -> dict[str, int]:
    """The categories of torch's memory timeline at its peak. The timeline also counts, by their shapes, tensors
    over memory the allocator did not allocate (torch.frombuffer over a Python buffer: the text recipes' corpus),
    so its total can exceed the allocator's peak by those."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # Deprecated in favour of a CUDA-only snapshot API; there is no CPU replacement yet.
        warnings.simplefilter("ignore", FutureWarning)
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _times, sizes = json.loads(path.read_text())
    if not sizes:
        return {}
    at_peak = max(sizes, key=sum)
    categories = at_peak[1:] if len(at_peak) == len(PROFILER_CATEGORIES) + 1 else at_peak
    return {name: int(b) for name, b in zip(PROFILER_CATEGORIES, categories) if b}
