"""Reading run directories back: what `ampctl train` left in each (summary, every step, overrides, error)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

ERROR_FILE = "error.txt"  # written by a multirun job that failed, so the sweep's table can show why
# summary.json's measured figures: null there stands for a non-finite value (JSON has no NaN), read back as NaN
SUMMARY_FIGURES = ("final_loss", "tail_loss", "final_loss_scale", "median_step_time_ms", "samples_per_s",
                   "tokens_per_s")


@dataclass
class RunRecord:
    path: Path
    summary: Optional[dict]
    metrics: list[dict] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def job(self) -> str:
        """The job number of a multirun job directory (`3_key=value,...`), else the directory's name."""
        head = self.name.split("_", 1)[0]
        return head if head.isdigit() else self.name

    @property
    def failed(self) -> bool:
        return self.summary is None

    def override_values(self) -> dict[str, str]:
        """`key=value` overrides of this run as a dict (Hydra's `+key`/`~key` prefixes kept in the key)."""
        return dict(o.split("=", 1) for o in self.overrides if "=" in o)


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in ("summary.json", "metrics.jsonl", ERROR_FILE))


def load_run(path: Path) -> RunRecord:
    summary_path, metrics_path = path / "summary.json", path / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if summary is not None:
        summary.update({k: float("nan") for k in SUMMARY_FIGURES if k in summary and summary[k] is None})
    metrics = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a run killed mid-write: keep the complete lines
    overrides_path = path / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(overrides_path)] if overrides_path.is_file() else []
    error_path = path / ERROR_FILE
    error = error_path.read_text().strip() if error_path.is_file() else None
    if summary is None and error is None:
        error = "did not finish (no summary.json)"
    return RunRecord(path, summary, metrics, overrides, error)


def find_runs(root: Path) -> list[RunRecord]:
    """The run directories directly under root (a multirun or compare directory), in numeric job order."""

    def order(path: Path) -> tuple[int, str]:
        head = path.name.split("_", 1)[0]
        return (int(head) if head.isdigit() else 1 << 30, path.name)

    return [load_run(p) for p in sorted((p for p in root.iterdir() if p.is_dir()), key=order) if is_run_dir(p)]
