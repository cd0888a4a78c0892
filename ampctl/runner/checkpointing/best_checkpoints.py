"""train.checkpoint.save_top_k: the K best checkpoints by an evaluation metric (train.checkpoint.monitor,
train.checkpoint.monitor_mode), kept in checkpoints/best/ beside the newest ones, as Lightning's
ModelCheckpoint(save_top_k=, monitor=, mode=) keeps
them. Each is written whole, fsynced and checksummed as every checkpoint is (checkpoint_files.save_atomic) and
resumes as any: `ampctl train resume=<run>/checkpoints/best/step_N.pt`. checkpoints/best/best.json lists them,
best first, with the metric that ranked them: the index a resumed run goes on from. A value that is not finite
never ranks; of equal values the earlier step stays.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ampctl import io, run_files
from ampctl.errors import UsageError
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.checkpointing.checkpoint_files import checkpoint_path, checkpoint_step

BEST_DIR = "best"
INDEX = "best.json"


def best_folder(run_dir: Path) -> Path:
    return run_dir / run_files.CHECKPOINTS / BEST_DIR


def _readable(index: Path) -> bool:
    try:
        return isinstance(json.loads(index.read_text(encoding="utf-8"))["checkpoints"], list)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_index(run_dir: Path) -> list[dict[str, Any]]:
    """The entries of best.json whose checkpoint exists, best first; [] without one (or unreadable: the files
    are the truth, an index that cannot be read ranks nothing)."""
    folder = best_folder(run_dir)
    try:
        entries = json.loads((folder / INDEX).read_text(encoding="utf-8"))["checkpoints"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [e for e in entries if isinstance(e, dict) and (folder / str(e.get("file"))).is_file()]


def write_index(run_dir: Path, monitor: str, direction: str, entries: list[dict[str, Any]]) -> None:
    io.write_json(best_folder(run_dir) / INDEX, {"monitor": monitor, "mode": direction, "checkpoints": entries})


def set_aside_after(run_dir: Path, step: int, folder: Path) -> int:
    """Resuming at `step`: the best checkpoints of later steps belong to the abandoned timeline; moved into folder
    (kept, never deleted) and out of the index. Returns how many."""
    entries = read_index(run_dir)
    later = [e for e in entries if e["step"] > step]
    if later:
        index = json.loads((best_folder(run_dir) / INDEX).read_text(encoding="utf-8"))
        for entry in later:
            checkpoint_files.move(best_folder(run_dir) / entry["file"], folder)
        write_index(run_dir, index["monitor"], index["mode"], [e for e in entries if e["step"] <= step])
    return len(later)


class BestCheckpoints:
    def __init__(self, run_dir: Path, k: int, monitor: str, direction: str, repair: bool = True) -> None:
        """repair: an index that cannot be read is set aside and rebuilt (by one process: rank 0)."""
        self.run_dir, self.k, self.monitor, self.direction = run_dir, k, monitor, direction
        self.entries = read_index(run_dir)  # a resumed run goes on ranking its timeline's evaluations
        self.repaired: Optional[str] = None  # what was said of an index that could not be read
        index = best_folder(run_dir) / INDEX
        if repair and index.is_file() and not _readable(index):
            self.entries = self._ranked_from_evaluations()
            aside = index.with_name(f"{INDEX}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            index.rename(aside)
            write_index(run_dir, monitor, direction, self.entries)
            self.repaired = (f"{index} could not be read (garbled): set aside as {aside.name}, and the best "
                             f"checkpoints ranked again from {run_files.EVALS} "
                             f"({len(self.entries)} of the files in {best_folder(run_dir).name}/)")

    def _ranked_from_evaluations(self) -> list[dict[str, Any]]:
        """The best checkpoints on disk, each with its evaluation's monitored value (evals.jsonl), best first."""
        values: dict[int, float] = {}
        path = self.run_dir / run_files.EVALS
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []:
            try:
                row = json.loads(line)
                values[int(row["step"])] = float(row[f"eval/{self.monitor}"])
            except (ValueError, KeyError, TypeError):
                continue
        entries = [{"step": step, "value": values[step], "file": file.name}
                   for file in best_folder(self.run_dir).glob("step_*.pt")
                   if (step := checkpoint_step(file)) in values and math.isfinite(values[step])]
        entries.sort(key=lambda e: (e["value"] if self.direction == "min" else -e["value"], e["step"]))
        return entries[:self.k]

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "min" else a > b

    def qualifies(self, row: dict[str, Any]) -> bool:
        """Whether the evaluation's monitored value earns a place among the K best."""
        key = f"eval/{self.monitor}"
        if key not in row:
            names = ", ".join(k.split("/", 1)[1] for k in row if k.startswith("eval/"))
            raise UsageError(f"train.checkpoint.monitor={self.monitor}: the recipe's evaluation gives no such metric; "
                             f"it gives {names}")
        value = row[key]
        if value is None or not math.isfinite(value):
            return False
        return len(self.entries) < self.k or self._better(value, self.entries[-1]["value"])

    def save(self, row: dict[str, Any], capture: Callable[[], dict[str, Any]]) -> Path:
        """Write the checkpoint of this evaluation's step among the best; the one it displaces is removed."""
        step, value = row["step"], row[f"eval/{self.monitor}"]
        path = best_folder(self.run_dir) / checkpoint_path(self.run_dir, step).name
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint_files.save_atomic(capture(), path)
        entries = [e for e in self.entries if e["step"] != step] + [{"step": step, "value": value, "file": path.name}]
        entries.sort(key=lambda e: (e["value"] if self.direction == "min" else -e["value"], e["step"]))
        kept, dropped = entries[:self.k], entries[self.k:]
        write_index(self.run_dir, self.monitor, self.direction, kept)  # the index never names a removed file
        for entry in dropped:
            checkpoint_files.remove(best_folder(self.run_dir) / entry["file"])
        self.entries = kept
        return path

    def best(self) -> Optional[dict[str, Any]]:
        """The summary's eval_best: the best checkpoint's step, metric and file."""
        if not self.entries:
            return None
        top = self.entries[0]
        return {"step": top["step"], self.monitor: top["value"],
                "checkpoint": str(best_folder(self.run_dir) / top["file"])}
