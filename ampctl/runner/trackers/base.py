"""What every tracker shares: the sink's verbs, the names its metrics go under, and the checks of a path it
writes."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path, PurePath
from typing import Any, ClassVar, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import run_files
from ampctl.engine.telemetry import StepRecord
from ampctl.errors import UsageError

# every StepRecord field but the step is a metric, under its own name (units in the names: step_time_ms, ...)
METRICS = tuple(f.name for f in fields(StepRecord) if f.name != "step")


def inside_the_run(key: str, value: str) -> None:
    """A tracker's path: relative, inside the run directory, and none of the run's own records."""
    parts, own = PurePath(value).parts, run_files.RUN_OWN_NAMES
    if not str(value).strip() or PurePath(value).is_absolute() or ".." in parts or \
            parts[0] in own | {run_files.TRACKER_IDS}:
        raise UsageError(f"{key}={value!r} is not allowed: expected a path inside the run directory (relative, "
                         f"no '..') that is none of the run's own records ({', '.join(sorted(own))}); "
                         "a tracker writes only its own files, inside the run it records")


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


def layer_error_values(row: dict[str, Any]) -> dict[str, Any]:
    """train.diff.every's measurement (a diffs.jsonl row) as a tracker's scalars: step, diff/gradient_error,
    diff/error_over_noise and each layer's local error (the largest of its output's, dgrad's and wgrad's) as
    diff/local/<layer>, and each router's share of tokens sent to other experts as diff/routing/<router>; an infinite
    one as inf (MLflow leaves it out)."""
    def number(value: Any) -> Optional[float]:
        return None if value is None else float(value)  # "inf": JSON's stand-in for infinity

    values: dict[str, Any] = {"step": row["step"], "diff/gradient_error": number(row["gradient_error"]),
                              "diff/error_over_noise": number(row["error_over_noise"])}
    for layer, figures in row["layers"].items():
        local = [number(figures[k]) for k in ("out_local", "dgrad_local", "wgrad_local") if figures[k] is not None]
        values[f"diff/local/{layer}"] = max(local) if local else None
    for router in row.get("routing", []):  # a mixture of experts: the share of tokens sent to other experts
        values[f"diff/routing/{router['router']}"] = router["flipped"]
    return values


def block_scale_values(row: dict[str, Any]) -> dict[str, Any]:
    """telemetry.blocks_every's measurement (a blocks.jsonl row) as a tracker's scalars: step, and per layer and
    operand blocks/<layer>/<operand>/flushed, .../saturated and .../error (the relative RMS quantization error)."""
    values: dict[str, Any] = {"step": row["step"]}
    for layer, operands in row["layers"].items():
        for operand, figures in operands.items():
            if isinstance(figures, dict):
                for figure in ("flushed", "saturated", "error"):
                    values[f"blocks/{layer}/{operand}/{figure}"] = figures[figure]
    return values


class Tracker:
    """A tracker is this class's subclass in a module of its own and ampctl/conf/logger/<name>.yaml, whose node
    names it (`_target_`) with every option at its default; `logger=<name>` chooses it.

    Made from its options (its logger.<name> node, typed by options_type), the run directory, the step a resumed
    run continues from and the id of the tracker run it continues (trackers.json). connect() before the run records
    anything, start(config) once, write(records) on log steps, flush() when the loop ends, then finish(summary) when the
    run succeeds or fail() when it does not: either ends the tracker's run. run_id: the id a resumed run
    continues its tracker run under (wandb's, MLflow's), once started; None for a tracker without one."""

    options_type: ClassVar[type]  # its options' dataclass: the keys of its YAML node, their types and defaults
    package: ClassVar[Optional[str]] = None  # the package its library comes in (None: the standard library's)
    extra: ClassVar[Optional[str]] = None  # the ampctl extra that installs the package

    def __init__(self, options: DictConfig, run_dir: Path, resumed_at: Optional[int], run_id: Optional[str]) -> None:
        self.options, self.run_dir, self.resumed_at, self.run_id = options, run_dir, resumed_at, run_id

    @staticmethod
    def check(options: DictConfig) -> None:
        """Refuse, in one line before anything is written, what this tracker could not do with options."""

    def connect(self) -> None:
        pass

    def start(self, cfg: DictConfig) -> None:
        pass

    def write(self, records: list[StepRecord]) -> None:
        raise NotImplementedError

    def write_eval(self, row: dict[str, Any]) -> None:
        """An evaluation (runner/eval_records.py's row: step, eval/<metric>...), after the records of its step."""
        raise NotImplementedError

    def write_layer_errors(self, row: dict[str, Any]) -> None:
        """train.diff.every's measurement (layer_error_values' row: step, diff/...), after the records of its step:
        scalars at the step, as an evaluation's are (a tracker whose evaluations go to a file of their own
        overrides this)."""
        self.write_eval(row)

    def write_block_scales(self, row: dict[str, Any]) -> None:
        """telemetry.blocks_every's measurement (block_scale_values' row): scalars at the step, as an evaluation's."""
        self.write_eval(row)

    def write_expert_load(self, row: dict[str, Any]) -> None:
        """A mixture of experts' load (expert_load_values' row): scalars at the step, as an evaluation's."""
        self.write_eval(row)

    def flush(self) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        self.fail()

    def fail(self) -> None:
        pass
