"""Step records: produced once per optimizer step, kept on the device, read back once per log interval.

The loop hands device tensors to :class:`Telemetry.record`; they are stacked into a preallocated device
buffer (no sync). On a log step one ``tolist()`` brings the whole interval back, step times come from the
timer, and the finished :class:`StepRecord` s go to the sinks (console, metrics.jsonl, summary).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Collection, Optional, Protocol, TextIO

import torch

from ampctl import io

# Columns of the device buffer of values, in order; the lr has a float64 buffer of its own.
_LOSS, _SCALE, _FOUND_INF, _GRAD_NORM = range(4)
_COLUMNS = 4


@dataclass
class StepRecord:
    step: int  # 1-based optimizer step
    loss: float  # mean over the micro-batches, unscaled
    loss_scale: float  # the scale that multiplied this step's loss (1.0 without scaling)
    skipped: bool  # the scaler found non-finite gradients and the optimizer did not apply the step
    skipped_total: int
    grad_norm: float  # total norm of the unscaled gradients, before clipping
    lr: float  # the learning rate this step used
    step_time_ms: float
    samples_per_s: float
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None  # achieved model TFLOP/s of one device (when the run counted its FLOPs)
    mfu: Optional[float] = None  # tflops / the device's dense peak for the mode's matmul dtype
    data_ms: Optional[float] = None  # host time the step spent getting its batches (loop.BatchStream)
    data_idle_ms: Optional[float] = None  # of data_ms, the time the loop's thread was idle (waiting on workers, I/O)

    def to_json(self) -> str:
        data = {k: v for k, v in asdict(self).items()
                if v is not None or k not in ("tokens_per_s", "tflops", "mfu", "data_ms", "data_idle_ms")}
        return io.dumps(data)  # JSON has no inf/nan: a skipped step's grad norm is written as null


class Sink(Protocol):
    def write(self, records: list[StepRecord]) -> None: ...

    def close(self) -> None: ...


class StepCounter(Protocol):
    """A sink that also counts every step as it ends (a progress bar): told on the host, from the loop's own
    count, never from the device; with the step's time where the host knows it without a sync (the CPU)."""

    def step_done(self, step: int, step_ms: Optional[float]) -> None: ...


class StepTimer:
    """Per-step wall time without syncing: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._last = self._now()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self._marks.append(self._now())

    def latest_ms(self) -> Optional[float]:
        """The step just marked, where reading it costs no sync (perf_counter on the CPU); None on CUDA."""
        if self.cuda or not self._marks:
            return None
        return (self._marks[-1] - (self._marks[-2] if len(self._marks) > 1 else self._last)) * 1e3

    def restart(self) -> None:
        """The next step is timed from now: what the host did since the last mark (a log step's read-back and
        sinks, a tracker starting) is no step's time."""
        self._last = self._now()

    def drain_ms(self) -> list[float]:
        """Durations of the steps marked since the last drain. Syncs on CUDA (called on log steps only)."""
        if not self._marks:
            return []
        if self.cuda:
            self._marks[-1].synchronize()
            spans = [a.elapsed_time(b) for a, b in zip([self._last, *self._marks[:-1]], self._marks)]
        else:
            spans = [(b - a) * 1e3 for a, b in zip([self._last, *self._marks[:-1]], self._marks)]
        self._last = self._marks[-1]
        self._marks = []
        return spans


class Telemetry:
    def __init__(
        self,
        device: torch.device,
        log_every: int,
        samples_per_step: int,
        tokens_per_step: Optional[int],
        sinks: list[Sink],
        flops_per_step: Optional[int] = None,  # model FLOPs of one step of this process
        peak_tflops: Optional[float] = None,  # the device's, for MFU
    ) -> None:
        self.log_every = log_every
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.flops_per_step, self.peak_tflops = flops_per_step, peak_tflops
        self.sinks = sinks
        self._counters: list[StepCounter] = [s for s in sinks if hasattr(s, "step_done")]  # type: ignore[misc]
        self._logged_once = False
        self.device = device
        # the values' buffer is allocated at the first record, in their widest dtype (float32 in every mode, unless
        # a recipe computes its loss in float64); the lr's is float64, so a float64 lr (CPU fused optimizers) is
        # recorded exactly
        self._values: Optional[torch.Tensor] = None
        self._lrs = torch.zeros(log_every, device=device, dtype=torch.float64)
        self._lr_rows = self._lrs.unbind()  # views made once: indexing a tensor every step costs a dispatch
        self._rows: tuple[torch.Tensor, ...] = ()
        self._pending_steps: list[int] = []
        self._pending_data_ms: list[tuple[Optional[float], Optional[float]]] = []
        self.timer = StepTimer(device)
        self.skipped_total = 0
        # Records of the latest log intervals, until the guards take them; the run's full record is
        # metrics.jsonl (nothing grows with the number of steps in memory).
        self._fresh: list[StepRecord] = []

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        loss_scale: torch.Tensor,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: torch.Tensor,
    ) -> None:
        """Queue this step's values on the device. Must be called before the scaler's update()."""
        values = (loss.detach(), loss_scale, found_inf, grad_norm)
        if self._values is None:
            dtype = functools.reduce(torch.promote_types, (v.dtype for v in values), torch.float32)
            self._values = torch.zeros(self.log_every, _COLUMNS, device=self.device, dtype=dtype)
            self._rows = self._values.unbind()
        # One cat writes the four values into their row, one copy the lr: the cheapest way on every device (a
        # foreach copy that casts falls back to a kernel per value), which matters on small steps where this
        # runs every millisecond or two.
        i = len(self._pending_steps)
        torch.cat([v.reshape(1) for v in values], out=self._rows[i])
        self._lr_rows[i].copy_(lr)  # a 0-dim tensor, as every torch optimizer's lr
        self._pending_steps.append(step)

    def end_step(self, last: bool, data_s: Optional[float] = None, data_idle_s: Optional[float] = None) -> None:
        """Called after every optimizer step (data_s: the host time it spent getting its batches, data_idle_s: of
        that, the time the loop's thread was idle); reads back and
        emits on log steps (every log_every-th step), on the last step, and on the first step this process
        runs, so that the first figures show at once rather than log_every steps later."""
        self.timer.mark()
        self._pending_data_ms.append((None if data_s is None else data_s * 1e3,
                                      None if data_idle_s is None else data_idle_s * 1e3))
        step = self._pending_steps[-1]
        if self._counters:
            step_ms = self.timer.latest_ms()
            for counter in self._counters:
                counter.step_done(step, step_ms)
        if step % self.log_every == 0 or last or not self._logged_once:
            self._logged_once = True
            self.flush()

    def flush(self) -> None:
        n = len(self._pending_steps)
        if n == 0:
            return
        rows = self._values[:n].tolist()  # the device->host copies of this interval
        lrs = self._lrs[:n].tolist()
        times = self.timer.drain_ms()
        records = []
        for step, row, lr, ms, (data, idle) in zip(self._pending_steps, rows, lrs, times, self._pending_data_ms):
            skipped = row[_FOUND_INF] > 0
            self.skipped_total += skipped
            per_s = 1e3 / ms if ms > 0 else float("inf")
            tflops = None if self.flops_per_step is None else self.flops_per_step * per_s / 1e12
            records.append(
                StepRecord(
                    step=step,
                    loss=row[_LOSS],
                    loss_scale=row[_SCALE],
                    skipped=skipped,
                    skipped_total=self.skipped_total,
                    grad_norm=row[_GRAD_NORM],
                    lr=lr,
                    step_time_ms=ms,
                    samples_per_s=self.samples_per_step * per_s,
                    tokens_per_s=None if self.tokens_per_step is None else self.tokens_per_step * per_s,
                    tflops=tflops,
                    mfu=self._mfu(tflops),
                    data_ms=data,
                    data_idle_ms=idle,
                )
            )
        self._pending_steps, self._pending_data_ms = [], []
        self._fresh.extend(records)
        for sink in self.sinks:
            sink.write(records)
        self.timer.restart()

    def _mfu(self, tflops: Optional[float]) -> Optional[float]:
        """tflops over the peak; none above 100%: a step faster than the peak says the peak is wrong (the summary
        has the CPU measured again), not that the step beat the hardware."""
        if tflops is None or not self.peak_tflops or tflops > self.peak_tflops:
            return None
        return tflops / self.peak_tflops

    def take_fresh(self) -> list[StepRecord]:
        """The records read back since the last call."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class ListSink:
    """Keeps every record in memory: for tests and short replays."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def write(self, records: list[StepRecord]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


class JsonlSink:
    """metrics.jsonl: one JSON object per optimizer step, flushed every log interval."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, records: list[StepRecord]) -> None:
        try:
            self._file.write("".join(r.to_json() + "\n" for r in records))
            self._file.flush()
        except OSError as exc:  # a full disk: name the file (a line cut short is set aside on resume)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        self._file.close()


def parse_metrics_line(line: str) -> StepRecord:
    row = json.loads(line)
    return StepRecord(**{k: (float("nan") if v is None else v) for k, v in row.items()})  # null: non-finite


def read_metrics(path: Path) -> list[StepRecord]:
    """metrics.jsonl back as records; a line that is not a row (cut short by a kill, garbled on disk) is
    passed over, and the rows after it are read (the runner sets such lines aside)."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(parse_metrics_line(line))
        except (json.JSONDecodeError, TypeError, AttributeError):
            continue
    return records


def summarize(records: list[StepRecord], timing_warmup_steps: int, untimed: Collection[int] = ()) -> dict:
    """Run statistics from the step records. Timings leave out the warm-up steps and the `untimed` ones (steps
    that compiled), when enough remain."""
    if not records:
        return {}
    timed = [r for r in records[timing_warmup_steps:] if r.step not in untimed] or records
    median_ms = statistics.median(r.step_time_ms for r in timed)
    last = records[-1]
    tail = records[-max(1, len(records) // 10):]
    summary = {
        "steps": last.step,
        "final_loss": last.loss,
        "tail_loss": statistics.fmean(r.loss for r in tail),
        "skipped_total": last.skipped_total,
        "final_loss_scale": last.loss_scale,
        "median_step_time_ms": median_ms,
        "samples_per_s": statistics.median(r.samples_per_s for r in timed),
        "timed_steps": len(timed),
    }
    if last.tokens_per_s is not None:
        summary["tokens_per_s"] = statistics.median(r.tokens_per_s for r in timed)  # type: ignore[misc]
    waited = [r for r in timed if r.data_ms is not None]
    if waited:  # the share of the step time spent waiting for batches (a starved device shows it here)
        summary["data_wait_fraction"] = sum(r.data_ms for r in waited) / sum(r.step_time_ms for r in waited)
    return summary
