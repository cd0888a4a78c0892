"""A run directory belongs to one run: a new run never writes into another's, and a resumed run that finds
rows without a checkpoint (a run killed before its first) starts clean, the old rows set aside."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from ampctl.errors import UsageError
from ampctl.runner.checkpoint import CHECKPOINT_DIR, list_checkpoints

# What a training run writes; Hydra's own files (.hydra/, train.log) are rewritten by every run and say nothing.
RUN_RECORDS = ("metrics.jsonl", "ranges.jsonl", "summary.json", "diagnosis.json")


def run_records(run_dir: Path) -> list[str]:
    """The records of a run already in run_dir (its checkpoints included)."""
    found = [name for name in RUN_RECORDS if (run_dir / name).is_file()]
    if (run_dir / CHECKPOINT_DIR).is_dir() and any((run_dir / CHECKPOINT_DIR).iterdir()):
        found.append(f"{CHECKPOINT_DIR}/")
    return found


def refuse_another_runs_directory(run_dir: str, resume: Optional[str]) -> None:
    """Checked before Hydra creates or writes into the run directory (its .hydra/ would be overwritten)."""
    if not str(run_dir).strip():
        raise UsageError("hydra.run.dir='' is not allowed: expected a directory for this run's records "
                         "(the current directory is not one)")
    found = run_records(Path(run_dir))
    if found and resume is None:
        raise UsageError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(found)}): continue it with "
                         "resume=auto, or choose another hydra.run.dir")


def set_aside_rows_without_checkpoint(run_dir: Path) -> list[Path]:
    """resume=auto found no checkpoint: a run killed before its first left rows that no state continues.
    They are moved to `<name>.set-aside-<time>` (kept, never deleted) so that this run starts at step 1."""
    if list_checkpoints(run_dir):
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name in RUN_RECORDS:
        path = run_dir / name
        if path.is_file():
            moved.append(path.rename(path.with_name(f"{name}.set-aside-{stamp}")))
    return moved
