"""The schemas of the experiment trackers (logger.*): each tracker's options, a null node where it is off (see
conf/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class WandbMode(Enum):
    online = "online"
    offline = "offline"  # written under the run directory; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class CsvLoggerConfig:
    file: str = "metrics.csv"  # in the run directory: every step's record, numbers only, units in the column names


@dataclass
class TensorBoardLoggerConfig:
    log_dir: str = "tensorboard"  # inside the run directory (relative): a tracker writes only its own run's files


@dataclass
class WandbLoggerConfig:
    project: str = "ampctl"
    entity: Optional[str] = None  # null: the logged-in user's default
    mode: Optional[WandbMode] = None  # null: wandb's own choice (WANDB_MODE, else online)
    name: Optional[str] = None  # null: the run directory's name
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowLoggerConfig:
    tracking_uri: Optional[str] = None  # null: MLflow's own (MLFLOW_TRACKING_URI, else its local default)
    experiment: str = "ampctl"
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class LoggerConfig:
    """Experiment trackers, any number at once (`logger=[tensorboard,csv]`): each ampctl/conf/logger/<name>.yaml
    turns its node on; a null node is off."""

    csv: Optional[CsvLoggerConfig] = None
    tensorboard: Optional[TensorBoardLoggerConfig] = None
    wandb: Optional[WandbLoggerConfig] = None
    mlflow: Optional[MlflowLoggerConfig] = None
