"""Experiment trackers (`logger=[csv,tensorboard,wandb,mlflow]`): sinks that receive the step records the run
already has, on log steps, when they have come back from the device anyway (a tracker never reads the
device), plus the resolved config at start and the summary at the end.

Each tracker speaks its library's own API: torch.utils.tensorboard's SummaryWriter, wandb.init/log/summary,
MLflow's client (params, metrics, tags, run status). The optional packages are imported only when chosen; a
missing one is refused before the run starts, naming the extra that installs it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import time
from dataclasses import fields
from pathlib import Path, PurePath
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files
from ampctl.conf.messages import one_line
from ampctl.engine.telemetry import StepRecord
from ampctl.errors import UsageError

# logger option -> (the module it imports, the ampctl extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
# the ids a resumed run continues its tracker runs under (wandb's run id, MLflow's run id)
# every StepRecord field but the step is a metric, under its own name (units in the names: step_time_ms, ...)
METRICS = tuple(f.name for f in fields(StepRecord) if f.name != "step")


def chosen(logger: DictConfig) -> list[str]:
    return [name for name in ("csv", "tensorboard", "wandb", "mlflow") if logger.get(name) is not None]


def check_loggers(logger: DictConfig) -> None:
    """Refuse, in one line before anything is written: a tracker whose package is not installed; a tracker
    file outside its run directory or over one of the run's own records (a tracker writes only its own files,
    inside the run it records); wandb online without a key (it would ask on stdin, or fail at step 1)."""
    for name in chosen(logger):
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            module, extra = PACKAGES[name]
            raise UsageError(f"logger={name}: the {module} package is not installed; pip install 'ampctl[{extra}]'")
    if logger.get("csv") is not None:
        inside_the_run("logger.csv.file", logger.csv.file)
    if logger.get("tensorboard") is not None:
        inside_the_run("logger.tensorboard.log_dir", logger.tensorboard.log_dir)
    if logger.get("wandb") is not None:
        _check_wandb_login(logger.wandb)


def inside_the_run(key: str, value: str) -> None:
    """A tracker's path: relative, inside the run directory, and none of the run's own records."""
    from ampctl.runner.ownership import RUN_OWN_NAMES

    parts = PurePath(value).parts
    if not str(value).strip() or PurePath(value).is_absolute() or ".." in parts or \
            parts[0] in RUN_OWN_NAMES | {run_files.TRACKER_IDS}:
        raise UsageError(f"{key}={value!r} is not allowed: expected a path inside the run directory (relative, "
                         f"no '..') that is none of the run's own records ({', '.join(sorted(RUN_OWN_NAMES))}); "
                         "a tracker writes only its own files, inside the run it records")


def _check_wandb_login(options: DictConfig) -> None:
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


def metric_values(record: StepRecord) -> dict[str, float]:
    """A record's metrics under train/<field>, the ones this run has (no tokens_per_s without tokens)."""
    values = {name: getattr(record, name) for name in METRICS}
    return {f"train/{name}": float(v) for name, v in values.items() if v is not None}


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as dotted keys -> scalars (lists as their text): what HParams and MLflow params
    take."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, (str, int, float, bool)) or node is None:
            out[prefix[:-1]] = "null" if node is None else node
        else:
            out[prefix[:-1]] = json.dumps(node)

    walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")
    return out


def summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers, and those of its sections one level down (eval: eval/loss, ...)."""
    numbers = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            numbers.update({f"{key}/{k.split('/')[-1]}": v for k, v in summary_numbers(value).items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = float(value)
    return numbers


def eval_values(row: dict[str, Any]) -> dict[str, float]:
    """An evaluation's metrics under their names (eval/loss, eval_fp32/accuracy); non-finite ones are null there."""
    return {k: float(v) for k, v in row.items() if "/" in k and v is not None}


class Tracker:
    """connect() before the run records anything, start(config) once, write(records) on log steps, flush()
    when the loop ends, then finish(summary) when the run succeeds or fail() when it does not: either ends the
    tracker's run."""

    name = ""  # the logger option that chose it

    def connect(self) -> None:
        pass

    def start(self, cfg: DictConfig) -> None:
        pass

    def write(self, records: list[StepRecord]) -> None:
        raise NotImplementedError

    def write_eval(self, row: dict[str, Any]) -> None:
        """An evaluation (evaluating.py's row: step, eval/<metric>...), after the records of its step."""
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        self.fail()

    def fail(self) -> None:
        pass


class CsvTracker(Tracker):
    """Every step's record as a CSV row. A resumed run keeps the rows up to the step it resumes at (the rows
    of steps it runs again are replaced)."""

    name = "csv"

    COLUMNS = ("step", *METRICS)

    def __init__(self, path: Path, resumed_at: Optional[int]) -> None:
        self.path, self.resumed_at = path, resumed_at

    def start(self, cfg: DictConfig) -> None:
        self._keep_rows_up_to_resume(self.path, list(self.COLUMNS))
        eval_path = self._eval_path()
        if eval_path.is_file():
            self._keep_rows_up_to_resume(eval_path, None)
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)

    def write(self, records: list[StepRecord]) -> None:
        for r in records:
            self._writer.writerow(["" if (v := getattr(r, c)) is None else (int(v) if isinstance(v, bool) else v)
                                   for c in self.COLUMNS])
        self._file.flush()

    def _keep_rows_up_to_resume(self, path: Path, header: Optional[list[str]]) -> None:
        """A fresh file with header, or the rows up to the step a resumed run starts from (its own header kept)."""
        rows: list[list[str]] = []
        if self.resumed_at is not None and path.is_file():
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
            header = header or (rows[0] if rows else [])
            rows = [row for row in rows[1:] if row and row[0].isdigit() and int(row[0]) <= self.resumed_at]
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([header or [], *rows] if header else rows)
        os.replace(tmp, path)

    def _eval_path(self) -> Path:
        return self.path.with_name(f"{self.path.stem}_eval.csv")

    def write_eval(self, row: dict[str, Any]) -> None:
        """Into <file>_eval.csv beside the step rows (its columns are the evaluation's: the recipe decides)."""
        values = eval_values(row)
        columns = ["step", *values]
        path = self._eval_path()
        fresh = not path.is_file() or path.read_text(encoding="utf-8").splitlines()[:1] != [",".join(columns)]
        with path.open("w" if fresh else "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if fresh:
                writer.writerow(columns)
            writer.writerow([row["step"], *values.values()])

    def fail(self) -> None:
        self._file.close()


class TensorBoardTracker(Tracker):
    """Scalars per step (train/loss, train/loss_scale, ...), the config as text, the summary as HParams (so
    that the runs of a sweep line up in TensorBoard's HParams dashboard)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, resumed_at: Optional[int]) -> None:
        self.log_dir, self.resumed_at = log_dir, resumed_at
        self._hparams: dict[str, Any] = {}

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


class WandbTracker(Tracker):
    """A wandb run in the run directory (its files under wandb/), resumed under the same id."""

    name = "wandb"

    def __init__(self, options: DictConfig, run_dir: Path, run_id: Optional[str]) -> None:
        self.options, self.run_dir, self.run_id = options, run_dir, run_id
        self.run: Any = None

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


class MlflowTracker(Tracker):
    """An MLflow run: the config as params, every step's record as metrics, the summary as metrics and tags,
    the run's status at the end. Resumed under the same run id."""

    name = "mlflow"

    def __init__(self, options: DictConfig, run_dir: Path, run_id: Optional[str]) -> None:
        self.options, self.run_dir, self.run_id = options, run_dir, run_id
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
                   for k, v in metric_values(r).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def write_eval(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, row["step"])
                                                    for k, v in eval_values(row).items()])

    def finish(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now, step = int(time.time() * 1000), int(summary.get("steps", 0))
        numbers = summary_numbers(summary)
        tags = [RunTag(f"ampctl.{k}", str(v)) for k, v in summary.items() if k not in numbers and v is not None]
        self.client.log_batch(self.run_id, metrics=[Metric(f"summary/{k}", v, now, step) for k, v in numbers.items()],
                              tags=tags)
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED")


class Trackers:
    """The run's trackers together, as one sink: started with the config, finished with the summary, failed
    when the run does. The ids a resumed run needs are kept in the run directory's trackers.json.

    They start after the first `start_after_steps` steps of this process: torch's CPU memory profiler
    (telemetry.profile_cpu_memory) records Python stacks over the build and steps 1-2, and a tracker's
    background threads inside that window made a 12-step run take minutes. Records of those steps wait here
    and are written when the trackers start."""

    def __init__(self, logger: DictConfig, cfg: DictConfig, run_dir: Path, resumed_at: Optional[int],
                 start_after_steps: int = 0) -> None:
        check_loggers(logger)
        self.run_dir, self.cfg = run_dir, cfg
        # nothing is imported or created here: each tracker does both in start()
        ids = self._ids() if resumed_at is not None else {}
        self.trackers: list[Tracker] = []
        if logger.csv is not None:
            self.trackers.append(CsvTracker(run_dir / logger.csv.file, resumed_at))
        if logger.tensorboard is not None:
            self.trackers.append(TensorBoardTracker(run_dir / logger.tensorboard.log_dir, resumed_at))
        if logger.wandb is not None:
            self.trackers.append(WandbTracker(logger.wandb, run_dir, ids.get("wandb")))
        if logger.mlflow is not None:
            self.trackers.append(MlflowTracker(logger.mlflow, run_dir, ids.get("mlflow")))
        for tracker in self.trackers:  # before the first record: a tracker that cannot start is refused now
            try:
                tracker.connect()
            except Exception as exc:  # noqa: BLE001 - a tracker's own refusal (a bad URI, a path): its line
                raise UsageError(f"logger={tracker.name}: could not start: {one_line(exc)}") from None
        self._start_after = start_after_steps
        self._waiting: list[StepRecord] = []
        self._waiting_evals: list[dict[str, Any]] = []
        self._started = self._ended = False
        if start_after_steps == 0:
            self._start()

    def _ids(self) -> dict[str, str]:
        """The tracker runs a resumed run continues. A trackers.json that cannot be read is refused, not
        taken for none: that would start new tracker runs for an old one's steps."""
        path = self.run_dir / run_files.TRACKER_IDS
        if not path.is_file():
            return {}
        try:
            ids = json.loads(path.read_bytes().decode("utf-8"))
            if isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()):
                return ids
        except (OSError, ValueError):
            pass
        raise UsageError(f"{path} cannot be read: it names the tracker runs this run continues; restore it, or "
                         f"delete it to start new tracker runs for the resumed steps")

    def _start(self) -> None:
        self._started = True
        for tracker in self.trackers:
            try:
                tracker.start(self.cfg)
            except Exception as exc:  # noqa: BLE001 - a tracker's own refusal (a bad URI, a path): its line
                raise UsageError(f"logger={tracker.name}: could not start: {one_line(exc)}") from None
        ids = {name: t.run_id for name, t in (("wandb", self._of(WandbTracker)), ("mlflow", self._of(MlflowTracker)))
               if t is not None and t.run_id}
        if ids:
            io.write_json(self.run_dir / run_files.TRACKER_IDS, ids)

    def _of(self, kind: type) -> Any:
        return next((t for t in self.trackers if isinstance(t, kind)), None)

    def write(self, records: list[StepRecord]) -> None:
        if not self._started:
            self._waiting += records
            if len(self._waiting) <= self._start_after:  # the window closes after its last step's records
                return
            self._start()
            records, self._waiting = self._waiting, []
        for tracker in self.trackers:
            tracker.write(records)
        self._write_waiting_evals()

    def write_eval(self, row: dict[str, Any]) -> None:
        """An evaluation; one inside the trackers' waiting window waits with its step's records."""
        self._waiting_evals.append(row)
        if self._started:
            self._write_waiting_evals()

    def _write_waiting_evals(self) -> None:
        rows, self._waiting_evals = self._waiting_evals, []
        for row in rows:
            for tracker in self.trackers:
                tracker.write_eval(row)

    def close(self) -> None:
        """The loop ended (a Sink's close): what was written is flushed; the runs end with the summary."""
        for tracker in self.trackers:
            tracker.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        if self._ended:
            return
        if not self._started:  # a run shorter than the window
            self._start()
            if self._waiting:
                for tracker in self.trackers:
                    tracker.write(self._waiting)
            self._write_waiting_evals()
        self._ended = True
        for tracker in self.trackers:
            tracker.finish(summary)

    def fail(self) -> None:
        """The run failed or was stopped before its summary: each tracker's run ends as failed (those that
        never started have nothing to end)."""
        if not self._ended:
            self._ended = True
            for tracker in self.trackers:
                if self._started:
                    tracker.fail()
