"""logger=wandb: a Weights & Biases run in the run directory (its files under wandb/), resumed under the same id."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.engine.telemetry import StepRecord
from ampctl.errors import UsageError
from ampctl.runner.trackers.base import Tracker, eval_values, metric_values


class WandbMode(Enum):
    online = "online"
    offline = "offline"  # written under the run directory; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class WandbOptions:
    project: str = "ampctl"
    entity: Optional[str] = None  # null: the logged-in user's default
    mode: Optional[WandbMode] = None  # null: wandb's own choice (WANDB_MODE, else online)
    name: Optional[str] = None  # null: the run directory's name
    tags: list[str] = field(default_factory=list)


class WandbTracker(Tracker):
    """A wandb run in the run directory (its files under wandb/), resumed under the same id."""

    options_type, package, extra = WandbOptions, "wandb", "wandb"

    def __init__(self, options: DictConfig, run_dir: Path, resumed_at: Optional[int], run_id: Optional[str]) -> None:
        super().__init__(options, run_dir, resumed_at, run_id)
        self.run: Any = None

    @staticmethod
    def check(options: DictConfig) -> None:
        """Online without a login it would ask on stdin, or fail at step 1."""
        mode = (options.mode.value if options.mode is not None else os.environ.get("WANDB_MODE", "online"))
        if mode not in ("offline", "disabled", "dryrun") and not os.environ.get("WANDB_API_KEY"):
            import wandb

            try:
                logged_in = wandb.login(prompt=False, verify=False)  # reads the stored key; no network, no prompt
            except TypeError:  # a wandb older than login(prompt=)
                logged_in = bool(wandb.api.api_key)
            if not logged_in:
                raise UsageError("logger=wandb: online mode needs a W&B login (wandb login, or WANDB_API_KEY); or "
                                 "logger.wandb.mode=offline writes under the run directory for `wandb sync` later")

    def start(self, cfg: DictConfig) -> None:
        import wandb

        o = self.options
        self.run = wandb.init(
            project=o.project, entity=o.entity, name=o.name or self.run_dir.name, tags=list(o.tags),
            mode=None if o.mode is None else o.mode.value, dir=str(self.run_dir),
            config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            id=self.run_id, resume="allow" if self.run_id else None,
            # the console stays ampctl's: wandb does not wrap stdout (it would tear the live view)
            settings=wandb.Settings(console="off", quiet=True),
        )
        self.run_id = self.run.id

    def write(self, records: list[StepRecord]) -> None:
        for r in records:
            self.run.log(metric_values(r), step=r.step)

    def write_eval(self, row: dict[str, Any]) -> None:
        self.run.log(eval_values(row), step=row["step"])

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(io.strict_json(summary))
        self.run.finish(exit_code=0)

    def fail(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
