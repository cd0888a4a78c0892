"""What a run leaves behind, as an object: rank 0's Recorder speaks and writes the run directory (metrics,
console, checkpoints, value ranges, summary); every other rank gets a NoRecorder, whose verbs do nothing.
The run calls the same verbs on either, instead of asking which rank it is at every turn."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Optional

from ampctl import io
from ampctl.engine.loop import TrainState
from ampctl.engine.telemetry import JsonlSink, Sink
from ampctl.runner import checkpoint
from ampctl.runner.console import make_console_sink

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


class Recorder:
    """Rank 0's record of the run (the loss it records is the mean over ranks)."""

    def __init__(self, run_dir: Path, echo: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.echo = echo

    def holding(self) -> contextlib.AbstractContextManager:
        """The run directory held for this run while it lives (runner/ownership.py)."""
        from ampctl.runner.ownership import holding

        return holding(self.run_dir)

    def open(self, resumed_at: Optional[int]) -> None:
        """Create the run directory; resuming at a step, drop what a killed run wrote after its checkpoint."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resumed_at is not None:
            keep_metrics_up_to(self.run_dir / METRICS_FILE, resumed_at)
            keep_ranges_up_to(self.run_dir / "ranges.jsonl", resumed_at)

    def set_aside_rows_without_checkpoint(self) -> list[Path]:
        from ampctl.runner.ownership import set_aside_rows_without_checkpoint

        return set_aside_rows_without_checkpoint(self.run_dir)

    def sinks(self, console_mode: Any, total_steps: int, tokens: bool,
              peak_memory: Callable[[], Optional[int]]) -> list[Sink]:
        console = make_console_sink(console_mode, total_steps, tokens, peak_memory)
        return [JsonlSink(self.run_dir / METRICS_FILE), *([console] if console is not None else [])]

    def save_checkpoint(self, payload: dict[str, Any], keep: int) -> None:
        checkpoint.save(payload, self.run_dir, keep)

    def ranges_log(self, state: TrainState, device: Any, every: Optional[int]):
        """telemetry.ranges_every's per-layer value ranges (ranges.jsonl), or None."""
        if not every:
            return None
        from ampctl.analysis.ranges import RangesLog

        return RangesLog(state.model, state.scaler, device, every, self.run_dir / RangesLog.FILE)

    def explain_stop(self, reason: str, step: int, diagnose: Callable[[], dict[str, Any]]) -> str:
        """A guard stopped the run: replay the step to find the layer (diagnosis.json); the stop's message."""
        from ampctl.runner.diagnose import DIAGNOSIS_FILE

        self.echo(f"stopped: {reason}; replaying step {step} to find the layer...")
        return f"{reason}. {diagnose()['summary']}. Written to {self.run_dir / DIAGNOSIS_FILE}"

    def write_summary(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        summary = build()
        io.write_json(self.run_dir / SUMMARY_FILE, summary)
        self.echo(final_line(summary, self.run_dir))
        return summary


class NoRecorder(Recorder):
    """Every other rank: silent, writes nothing (its errors still raise)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, lambda _message: None)

    def holding(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def open(self, resumed_at: Optional[int]) -> None:
        pass

    def set_aside_rows_without_checkpoint(self) -> list[Path]:
        return []

    def sinks(self, *_args: Any) -> list[Sink]:
        return []

    def save_checkpoint(self, payload: dict[str, Any], keep: int) -> None:
        pass

    def ranges_log(self, *_args: Any):
        return None

    def explain_stop(self, reason: str, step: int, diagnose: Callable[[], dict[str, Any]]) -> str:
        return reason  # rank 0 replays and explains

    def write_summary(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir)}


def keep_metrics_up_to(path: Path, step: int) -> None:
    """Resuming at `step`: drop the rows a killed run wrote after its checkpoint (and a line cut by the
    kill), so that metrics.jsonl continues without gaps or duplicates."""
    from ampctl.engine.telemetry import read_metrics

    if not path.is_file():
        return
    kept = [line for line, record in zip(path.read_text(encoding="utf-8").splitlines(), read_metrics(path))
            if record.step <= step]
    io.atomic_write_text(path, "".join(line + "\n" for line in kept))


def keep_ranges_up_to(path: Path, step: int) -> None:
    """As keep_metrics_up_to, for telemetry.ranges_every's ranges.jsonl."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a line cut by a kill ends what was written
    io.atomic_write_text(path, "".join(line + "\n" for line in kept))


def final_line(summary: dict, run_dir: Path) -> str:
    rate = (f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary
            else f"{summary['samples_per_s']:,.0f} samples/s")
    return (
        f"done: {summary['steps']} steps | final loss {summary['final_loss']:.4f} | skipped "
        f"{summary['skipped_total']} | final scale {summary['final_loss_scale']:g} | median "
        f"{summary['median_step_time_ms']:.1f} ms/step, {rate} | {run_dir / SUMMARY_FILE}"
    )
