"""`ampctl train [overrides]`: one Hydra app, so -m, --cfg, --help, -cd and run dirs all work."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ampctl.errors import USAGE_EXIT_CODE, UsageError
from ampctl.run import run_training


HYDRA_FILES = {".hydra", "train.log", "compare.log"}


def remove_if_only_hydra_files(run_dir: Path) -> None:
    """A run refused before training leaves no directory behind (Hydra creates it before the job runs)."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir)


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="train")
def train(cfg: DictConfig) -> Optional[float]:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        summary = run_training(cfg, run_dir, choices=dict(hydra_cfg.runtime.choices))
    except UsageError as exc:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # the sweeper marks this job failed; the other jobs still run
        remove_if_only_hydra_files(run_dir)
        print(f"ampctl train: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    return summary.get("final_loss")
