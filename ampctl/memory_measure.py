"""The measured peak of a few training steps, from model build to the last optimizer step.

CUDA: torch.cuda.max_memory_allocated, the caching allocator's high-water mark of tensor memory (its
reserve, the CUDA context and library workspaces are outside it; the reserve is reported beside it).
CPU: torch's memory profiler (torch.profiler with profile_memory=True), which sees every allocation of
torch's CPU allocator with the tensor it belongs to, so the peak comes with a breakdown by category
(parameters, optimizer state, gradients, activations, temporaries...). The process's max RSS, which the
training runs report, would include the interpreter and torch's own code, hundreds of MiB.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

# The order of the categories in torch's memory timeline (torch.profiler._memory_profiler's
# _CATEGORY_TO_INDEX), after its leading total column; None is memory it could not attribute.
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
def measure_peak(device: torch.device) -> Iterator[MeasuredPeak]:
    """Measures the peak of what runs inside; the result is filled in on exit."""
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
    from torch.profiler import ProfilerActivity, profile

    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                  with_stack=True) as prof:
        yield result
    result.bytes, result.breakdown = _timeline_peak(prof)
    result.source = "torch memory profiler (CPU allocator)"


@contextmanager
def _quiet_kineto() -> Iterator[None]:
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


def _timeline_peak(prof) -> tuple[int, dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # Deprecated in favour of a CUDA-only snapshot API; there is no CPU replacement yet.
        warnings.simplefilter("ignore", FutureWarning)
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _times, sizes = json.loads(path.read_text())
    if not sizes:
        return 0, {}
    at_peak = max(sizes, key=sum)
    categories = at_peak[1:] if len(at_peak) == len(PROFILER_CATEGORIES) + 1 else at_peak
    breakdown = {name: int(b) for name, b in zip(PROFILER_CATEGORIES, categories) if b}
    return int(sum(at_peak)), breakdown
