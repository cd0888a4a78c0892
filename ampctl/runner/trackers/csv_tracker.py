"""logger=csv: every step's record as a row of metrics.csv (numbers only, the units in the column names)."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from ampctl.engine.telemetry import StepRecord
from ampctl.runner.trackers.base import METRICS, Tracker, eval_values, inside_the_run


@dataclass
class CsvOptions:
    file: str = "metrics.csv"  # in the run directory: every step's record, numbers only, units in the column names


class CsvTracker(Tracker):
    """Every step's record as a CSV row. A resumed run keeps the rows up to the step it resumes at (the rows
    of steps it runs again are replaced)."""

    COLUMNS = ("step", *METRICS)
    options_type = CsvOptions

    def __init__(self, options: DictConfig, run_dir: Path, resumed_at: Optional[int], run_id: Optional[str]) -> None:
        super().__init__(options, run_dir, resumed_at, run_id)
        self.path = run_dir / options.file

    @staticmethod
    def check(options: DictConfig) -> None:
        inside_the_run("logger.csv.file", options.file)

    def start(self, cfg: DictConfig) -> None:
        self._keep_rows_up_to_resume(self.path, list(self.COLUMNS))
        for path in (self._eval_path(), self._side_path("diff"), self._side_path("blocks")):
            if path.is_file():
                self._keep_rows_up_to_resume(path, None)
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
        return self._side_path("eval")

    def _side_path(self, kind: str) -> Path:
        return self.path.with_name(f"{self.path.stem}_{kind}.csv")

    def write_eval(self, row: dict[str, Any]) -> None:
        """Into <file>_eval.csv beside the step rows (its columns are the evaluation's: the recipe decides)."""
        self._append(self._eval_path(), row["step"], eval_values(row))

    def write_layer_errors(self, row: dict[str, Any]) -> None:
        """Into <file>_diff.csv: diff/gradient_error, diff/error_over_noise, diff/local/<layer> (empty: none)."""
        self._append(self._side_path("diff"), row["step"], {k: v for k, v in row.items() if k != "step"})

    def write_block_scales(self, row: dict[str, Any]) -> None:
        """Into <file>_blocks.csv: blocks/<layer>/<operand>/flushed, .../saturated, .../error."""
        self._append(self._side_path("blocks"), row["step"], {k: v for k, v in row.items() if k != "step"})

    def write_expert_load(self, row: dict[str, Any]) -> None:
        """Into <file>_experts.csv: experts/max_over_mean, experts/<layer>/max_over_mean."""
        self._append(self._side_path("experts"), row["step"], {k: v for k, v in row.items() if k != "step"})

    def _append(self, path: Path, step: int, values: dict[str, Any]) -> None:
        """A row of a side file whose columns are its rows' (a file of other columns begins again)."""
        columns = ["step", *values]
        fresh = not path.is_file() or path.read_text(encoding="utf-8").splitlines()[:1] != [",".join(columns)]
        with path.open("w" if fresh else "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if fresh:
                writer.writerow(columns)
            writer.writerow([step, *("" if v is None else v for v in values.values())])

    def fail(self) -> None:
        self._file.close()
