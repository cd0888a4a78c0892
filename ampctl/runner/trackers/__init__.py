"""Experiment trackers (`logger=[csv,tensorboard,wandb,mlflow]`): sinks that receive the step records the run
already has, on log steps, when they have come back from the device anyway (a tracker never reads the
device), plus the resolved config at start and the summary at the end.

Each tracker speaks its library's own API (one module each beside this one): torch.utils.tensorboard's
SummaryWriter, wandb.init/log/summary, MLflow's client (params, metrics, tags, run status). A tracker is a
`_target_` node, as recipes and optimizers are: ampctl/conf/logger/<name>.yaml names its Tracker subclass, whose
class attributes say its options (typed here), its package and the extra that installs it. The optional
packages are imported only when chosen; a missing one is refused before the run starts, naming the extra.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files
from ampctl.analysis.expert_load import expert_load_values
from ampctl.conf.messages import one_line
from ampctl.conf.options import typed_options
from ampctl.engine.telemetry import StepRecord
from ampctl.errors import UsageError
from ampctl.runner.trackers.base import METRICS, Tracker, block_scale_values, layer_error_values

__all__ = ["METRICS", "Tracker", "Trackers", "check_loggers", "chosen", "tracker_class"]


def chosen(logger: DictConfig) -> list[str]:
    """The trackers the run records to (a null node: one an older run's config had off)."""
    return [str(name) for name, node in logger.items() if node is not None]


def _target(name: str, node: DictConfig) -> str:
    """The node's `_target_`; a run recorded before trackers were `_target_` nodes names ampctl's of that name."""
    target = node.get("_target_")
    shipped = resources.files("ampctl.conf").joinpath("logger", f"{name}.yaml")
    if target is None and shipped.is_file():
        target = OmegaConf.create(shipped.read_text(encoding="utf-8"))[name]["_target_"]
    if target is None:
        raise UsageError(f"logger.{name}: names no tracker; its node needs _target_: a Tracker subclass (as "
                         "ampctl/conf/logger/*.yaml have)")
    return str(target)


def tracker_class(name: str, node: DictConfig) -> type[Tracker]:
    """The Tracker subclass logger.<name> names (UsageError: one that cannot be imported or is no tracker)."""
    target = _target(name, node)
    try:
        cls = get_class(target)
    except Exception as exc:  # noqa: BLE001 - any failure to import it is the same mistake: one line
        raise UsageError(f"logger.{name}._target_={target!r} cannot be imported: {one_line(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Tracker) and hasattr(cls, "options_type")):
        raise UsageError(f"logger.{name}._target_={target!r} is not a tracker: a subclass of "
                         "ampctl.runner.trackers.Tracker with its options_type")
    return cls


def check_loggers(logger: DictConfig) -> dict[str, tuple[type[Tracker], DictConfig]]:
    """Each chosen tracker's class and typed options. Refused, in one line before anything is written: a tracker
    whose package is not installed; what a tracker's own check refuses (a file outside its run directory or over
    one of the run's own records: a tracker writes only its own files, inside the run it records; wandb online
    without a key)."""
    trackers = {}
    for name in chosen(logger):
        cls = tracker_class(name, logger[name])
        if cls.package is not None and importlib.util.find_spec(cls.package) is None:
            install = f"ampctl[{cls.extra}]" if cls.extra else cls.package  # a tracker of one's own: its package
            raise UsageError(f"logger={name}: the {cls.package} package is not installed; pip install '{install}'")
        values = {key: value for key, value in logger[name].items() if key != "_target_"}
        trackers[name] = (cls, typed_options(f"logger.{name}", values, cls.options_type))
    for cls, options in trackers.values():
        cls.check(options)
    return trackers


class Trackers:
    """The run's trackers together, as one sink: started with the config, finished with the summary, failed
    when the run does. The ids a resumed run needs are kept in the run directory's trackers.json.

    They start after the first `start_after_steps` steps of this process: torch's CPU memory profiler
    (telemetry.profile_cpu_memory) records Python stacks over the build and steps 1-2, and a tracker's
    background threads inside that window made a 12-step run take minutes. Records of those steps wait here
    and are written when the trackers start."""

    def __init__(self, chosen: dict[str, tuple[type[Tracker], DictConfig]], cfg: DictConfig, run_dir: Path,
                 resumed_at: Optional[int], start_after_steps: int = 0) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        # chosen: checked with the run's plan (runner/plan.py's check_loggers), not again. Nothing of a tracker's
        # library is imported or created here: each tracker does both in start()
        ids = self._ids() if resumed_at is not None else {}
        self.by_name: dict[str, Tracker] = {
            name: cls(options, run_dir, resumed_at, ids.get(name)) for name, (cls, options) in chosen.items()}
        self.trackers = list(self.by_name.values())
        for name, tracker in self.by_name.items():  # before the first record: one that cannot start is refused now
            try:
                tracker.connect()
            except Exception as exc:  # noqa: BLE001 - a tracker's own refusal (a bad URI, a path): its line
                raise UsageError(f"logger={name}: could not start: {one_line(exc)}") from None
        self._start_after = start_after_steps
        self._waiting: list[StepRecord] = []
        self._waiting_evals: list[tuple[str, dict[str, Any]]] = []  # (the tracker's verb, its row)
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
        for name, tracker in self.by_name.items():
            try:
                tracker.start(self.cfg)
            except Exception as exc:  # noqa: BLE001 - a tracker's own refusal (a bad URI, a path): its line
                raise UsageError(f"logger={name}: could not start: {one_line(exc)}") from None
        ids = {name: tracker.run_id for name, tracker in self.by_name.items() if tracker.run_id}
        if ids:
            io.write_json(self.run_dir / run_files.TRACKER_IDS, ids)

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
        self._waiting_evals.append(("write_eval", row))
        if self._started:
            self._write_waiting_evals()

    def write_layer_errors(self, row: dict[str, Any]) -> None:
        """train.diff.every's measurement (a diffs.jsonl row), as diff/... scalars; waits as an evaluation does."""
        self._waiting_evals.append(("write_layer_errors", layer_error_values(row)))
        if self._started:
            self._write_waiting_evals()

    def write_block_scales(self, row: dict[str, Any]) -> None:
        """telemetry.blocks_every's measurement (a blocks.jsonl row), as blocks/... scalars; waits as an evaluation
        does."""
        self._waiting_evals.append(("write_block_scales", block_scale_values(row)))
        if self._started:
            self._write_waiting_evals()

    def write_expert_load(self, row: dict[str, Any]) -> None:
        """A mixture of experts' load (an experts.jsonl row), as experts/... scalars; waits as an evaluation does."""
        self._waiting_evals.append(("write_expert_load", expert_load_values(row)))
        if self._started:
            self._write_waiting_evals()

    def _write_waiting_evals(self) -> None:
        rows, self._waiting_evals = self._waiting_evals, []
        for verb, row in rows:
            for tracker in self.trackers:
                getattr(tracker, verb)(row)

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
