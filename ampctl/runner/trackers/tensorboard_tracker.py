"""logger=tensorboard: event files under the run directory, through torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl.engine.telemetry import StepRecord
from ampctl.runner.trackers.base import (
    Tracker,
    eval_values,
    flat_config,
    inside_the_run,
    metric_values,
    summary_numbers,
)


@dataclass
class TensorBoardOptions:
    log_dir: str = "tensorboard"  # inside the run directory (relative): a tracker writes only its own run's files


class TensorBoardTracker(Tracker):
    """Scalars per step (train/loss, train/loss_scale, ...), the config as text, the summary as HParams (so
    that the runs of a sweep line up in TensorBoard's HParams dashboard)."""

    options_type, package, extra = TensorBoardOptions, "tensorboard", "tensorboard"

    def __init__(self, options: DictConfig, run_dir: Path, resumed_at: Optional[int], run_id: Optional[str]) -> None:
        super().__init__(options, run_dir, resumed_at, run_id)
        self.log_dir = run_dir / options.log_dir
        self._hparams: dict[str, Any] = {}

    @staticmethod
    def check(options: DictConfig) -> None:
        inside_the_run("logger.tensorboard.log_dir", options.log_dir)

    def start(self, cfg: DictConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops the events a stopped run had written past its checkpoint
        self.writer = SummaryWriter(log_dir=str(self.log_dir),
                                    purge_step=None if self.resumed_at is None else self.resumed_at + 1)
        self._hparams = flat_config(cfg)
        self.writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(cfg, resolve=True) + "```")

    def write(self, records: list[StepRecord]) -> None:
        for r in records:
            for name, value in metric_values(r).items():
                self.writer.add_scalar(name, value, r.step)
        self.writer.flush()

    def write_eval(self, row: dict[str, Any]) -> None:
        for name, value in eval_values(row).items():
            self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"summary/{k}": v for k, v in summary_numbers(summary).items()}
        for summary_proto in hparams(self._hparams, metrics):
            self.writer.file_writer.add_summary(summary_proto)
        for name, value in metrics.items():
            self.writer.add_scalar(name, value)
        self.writer.close()

    def fail(self) -> None:
        self.writer.close()
