"""train.profile=N: a torch.profiler trace of N steady steps in the run directory, and the one-screen summary of
where their time went (analysis/step_time.py).

The window opens after the steps whose times the run leaves out anyway (timing warm-up, the CPU memory
measurement, compilation in the first step) and one profiler warm-up step; its steps are left out of the step
times in turn, the profiler's own overhead being in them. Every rank writes its own trace; rank 0 prints the
summary. Traces are Chrome trace JSON, gzipped, named as TensorBoard's trace handler names them
(`<worker>.<span>.pt.trace.json.gz`), so Perfetto and TensorBoard both open them.
"""

from __future__ import annotations

import gzip
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from ampctl import io
from ampctl.analysis import step_time as breakdowns
from ampctl.analysis.matmul_dtypes import LayerRanges, MatmulDtypes, matmul_dtypes
from ampctl.analysis.memory.measure import quiet_kineto
from ampctl.runner.profile_window import PROFILER_WARMUP_STEPS

PROFILE_DIR = "profile"


class StepProfiler:
    """Profiles steps first_step..first_step+steps-1 (1-based, of the whole run) when steps is set; step() after
    every training step. Does nothing when steps is None."""

    def __init__(self, steps: Optional[int], first_step: int, start_step: int, run_dir: Path, rank: int,
                 device: torch.device, echo: Callable[[str], None]) -> None:
        self.steps, self.first_step, self.run_dir, self.rank = steps, first_step, run_dir, rank
        self.device, self.echo = device, echo
        self.result: Optional[breakdowns.StepBreakdown] = None
        self.matmuls: Optional[MatmulDtypes] = None  # what precision the window's matmuls ran in
        self._layers: Optional[LayerRanges] = None
        self._rows: list = []
        self.trace: Optional[Path] = None
        self._profiler: Optional[profile] = None
        self._open = ExitStack()
        if steps is not None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            # record_shapes: each matmul's operand shapes and dtypes, for the FLOPs by dtype (analysis/matmul_dtypes.py)
            self._profiler = profile(activities=activities, on_trace_ready=self._ready, record_shapes=True,
                                     schedule=schedule(
                skip_first=first_step - PROFILER_WARMUP_STEPS, wait=0, warmup=PROFILER_WARMUP_STEPS, active=steps,
                repeat=1))
            # the schedule's step count is the run's step under way: the trace's ProfilerStep#N is step N
            self._profiler.step_num = start_step + 1
            self._profiler.current_action = self._profiler.schedule(self._profiler.step_num)

    @property
    def untimed_steps(self) -> set[int]:
        """The steps whose times the profiler distorts: its warm-up step, the window, and the step after it, whose
        time holds the writing of the trace."""
        if self.steps is None:
            return set()
        return set(range(self.first_step - PROFILER_WARMUP_STEPS, self.first_step + self.steps + 1))

    def __enter__(self) -> "StepProfiler":
        if self._profiler is not None:
            self._open.enter_context(quiet_kineto())
            self._open.enter_context(self._profiler)  # a window cut short by a stop is written as far as it went
        return self

    def watch(self, model: torch.nn.Module, layer_rows: list) -> None:
        """The model whose leaf layers' forwards are ranged in the window (so that each matmul is the layer's that
        ran it), and the precision each was meant to compute in (PrecisionPolicy.layer_rows)."""
        if self._profiler is not None:
            self._layers = LayerRanges(model)
            self._rows = layer_rows

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()
            recording = self._profiler.current_action in (ProfilerAction.WARMUP, ProfilerAction.RECORD,
                                                          ProfilerAction.RECORD_AND_SAVE)
            if recording and self._layers is not None:
                self._layers.attach()

    def __exit__(self, *exc_info: object) -> None:
        self._open.__exit__(*exc_info)

    def stop_profiling(self) -> None:
        """Profile no more (its window, profiled or not, stays what summary() and untimed_steps say): a run that
        goes back to a checkpoint (guard.on_trip=escalate) profiles its first timeline only."""
        if self._layers is not None:
            self._layers.detach()
        self._profiler, self._open, self._layers = None, ExitStack(), None

    def _ready(self, prof: profile) -> None:
        last = self.first_step + self.steps - 1
        folder = self.run_dir / PROFILE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}.steps{self.first_step}-{last}.pt.trace.json.gz"
        plain = trace.with_name(trace.name.removesuffix(".gz") + ".tmp")
        packed = trace.with_name(trace.name + ".tmp")
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        plain.unlink()
        os.replace(packed, trace)  # whole or not at all: a kill leaves *.tmp, removed when the run starts again
        self.trace = trace
        if self._layers is not None:
            self._layers.detach()
        events = list(prof.events())
        self.result = breakdowns.breakdown(events, self.device.type)
        self.matmuls = matmul_dtypes(events, self.result.steps, self._rows)
        lines = breakdowns.render(self.result, self.first_step, str(trace.relative_to(self.run_dir)))
        io.atomic_write_text(folder / f"rank{self.rank}.steps{self.first_step}-{last}.txt", "\n".join(lines) + "\n")
        matmul_lines = self.matmuls.lines()
        for line in [*lines, *matmul_lines]:
            self.echo(line)

    def summary(self) -> Optional[dict]:
        """summary.json's `profile`: the window, the trace and the breakdown."""
        if self.result is None:
            return None
        return {"first_step": self.first_step, "trace": str(self.trace.relative_to(self.run_dir)),
                **self.result.as_dict(), "matmul_dtypes": self.matmuls.as_dict() if self.matmuls else None}
