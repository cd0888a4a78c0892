"""When a training run writes its checkpoints: every train.checkpoint.every steps, on the first log step
train.checkpoint.every_s seconds after the last one (the ranks agree there), at the last step, and with
train.checkpoint.save_top_k the best by the monitored evaluation; each one through the writer of the run's checkpoint
format (runner/checkpointing/checkpoint.py) and, once whole, to the mirror."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig

from ampctl.conf.schema import CheckpointFormat
from ampctl.conf.train_schema import monitor_direction
from ampctl.engine.loop import TrainState
from ampctl.engine.telemetry import Telemetry
from ampctl.runner.checkpointing import checkpoint
from ampctl.runner.checkpointing.best_checkpoints import BestCheckpoints
from ampctl.runner.rank_zero import told_to_every_rank
from ampctl.runner.recorder import Recorder


class Checkpointer:
    """Called after every step (on every rank: saving is a collective); see the module docstring for when it saves."""

    def __init__(self, cfg: DictConfig, choices: dict[str, str], state: TrainState, telemetry: Telemetry,
                 recorder: Recorder, on_saved: Optional[Callable[[Path], None]]) -> None:
        """on_saved(path): each checkpoint once whole in the run directory (the mirror's upload, a thread's)."""
        self.cfg, self.choices, self.state, self.telemetry, self.recorder = cfg, choices, state, telemetry, recorder
        self.parallel = state.parallel
        train = cfg.train
        direction = train.checkpoint.monitor_mode or monitor_direction(train.checkpoint.monitor)
        self.best = (BestCheckpoints(recorder.run_dir, train.checkpoint.save_top_k, train.checkpoint.monitor, direction,
                                     repair=self.parallel.is_main) if train.checkpoint.save_top_k else None)
        if self.best is not None and self.best.repaired:
            recorder.echo(f"warning: {self.best.repaired}")
        self.saved_at = time.monotonic()
        self.writer = checkpoint.writer(cfg, recorder.run_dir, state, on_saved)
        self.sharded = cfg.distributed.checkpoint_format is CheckpointFormat.sharded
        self.last: Optional[Path] = None

    def __call__(self, last: bool, evaluated: Optional[dict] = None) -> None:
        """evaluated: the evaluation after this step, if there was one (it may earn a place among the best)."""
        if last or self._due(self.state.step):
            self.telemetry.flush()  # the steps a checkpoint covers are in metrics.jsonl before it exists
            self.last = self.writer.save(self._payload())  # an async save is complete by close()
            self.saved_at = time.monotonic()
        if evaluated is not None and self.best is not None and self.parallel.main_value(self.best.qualifies(evaluated)):
            payload = self._payload()  # on every rank: gathering a sharded model is a collective
            best = self.best
            told_to_every_rank(self.parallel, f"a best checkpoint at step {self.state.step}",
                               lambda: best.save(evaluated, lambda: payload))

    def _payload(self) -> dict:
        batches = self.state.step * self.cfg.train.grad_accum_steps
        return checkpoint.capture(self.state, self.cfg, self.choices, batches, self.telemetry.skipped_total,
                                  self.sharded, self.recorder.identity)

    def _due(self, step: int) -> bool:
        train = self.cfg.train
        if train.checkpoint.every is not None and step % train.checkpoint.every == 0:
            return True
        if train.checkpoint.every_s is None or step % train.log_every:
            return False
        return self.parallel.agree(time.monotonic() - self.saved_at >= train.checkpoint.every_s)
