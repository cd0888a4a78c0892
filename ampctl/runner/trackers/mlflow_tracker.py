"""logger=mlflow: an MLflow run through MLflow's client, resumed under the same run id.

MLflow's SQL stores keep a NaN but turn an infinity into +-1.8e308, a finite number that would spike every chart
of the metric: an infinite value (the grad norm of a step whose gradients overflowed) is left out at its step,
never written as a stand-in (docs/runs.md: non-finite values, sink by sink)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from ampctl.engine.telemetry import StepRecord
from ampctl.runner.trackers.base import Tracker, eval_values, flat_config, metric_values, summary_numbers


@dataclass
class MlflowOptions:
    tracking_uri: Optional[str] = None  # null: MLflow's own (MLFLOW_TRACKING_URI, else its local default)
    experiment: str = "ampctl"
    run_name: Optional[str] = None  # null: the run directory's name


class MlflowTracker(Tracker):
    """An MLflow run: the config as params, every step's record as metrics, the summary as metrics and tags,
    the run's status at the end. Resumed under the same run id."""

    options_type, package, extra = MlflowOptions, "mlflow", "mlflow"

    def __init__(self, options: DictConfig, run_dir: Path, resumed_at: Optional[int], run_id: Optional[str]) -> None:
        super().__init__(options, run_dir, resumed_at, run_id)
        self.logged_up_to = 0  # a resumed run's steps MLflow holds already

    def connect(self) -> None:
        """The tracking store, reached before the run records anything (a bad URI is refused up front)."""
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.options.tracking_uri)
        self.client.search_experiments(max_results=1)

    def start(self, cfg: DictConfig) -> None:
        from mlflow.entities import Param

        if self.run_id is not None:  # resumed: the run goes on
            self.client.update_run(self.run_id, status="RUNNING")
            # MLflow's metric history is append-only: the steps a killed run logged past its checkpoint stay,
            # and are not logged twice (a resumed run repeats them; on a CPU bit for bit)
            self.logged_up_to = max((m.step for m in self.client.get_metric_history(self.run_id, "train/loss")),
                                    default=0)
            return
        name = self.options.experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=self.options.run_name or self.run_dir.name,
                                     tags={"ampctl.run_dir": str(self.run_dir)})
        self.run_id = run.info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def write(self, records: list[StepRecord]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, r.step) for r in records if r.step > self.logged_up_to
                   for k, v in metric_values(r).items() if not math.isinf(v)]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def write_eval(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, row["step"])
                                                    for k, v in eval_values(row).items() if not math.isinf(v)])

    def finish(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now, step = int(time.time() * 1000), int(summary.get("steps", 0))
        numbers = summary_numbers(summary)
        tags = [RunTag(f"ampctl.{k}", str(v)) for k, v in summary.items() if k not in numbers and v is not None]
        self.client.log_batch(self.run_id, metrics=[Metric(f"summary/{k}", v, now, step) for k, v in numbers.items()
                                                    if not math.isinf(v)], tags=tags)
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED")
