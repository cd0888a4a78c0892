"""`ampctl inspect [overrides]`: a Hydra app over ampctl/conf/inspect.yaml (train's config plus inspect.*)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ampctl.shell.checks import job_of, task_overrides
from ampctl.shell.studies import refused_in_one_line


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="inspect")
def inspect(cfg: DictConfig) -> None:
    # the study imports torch: here, so that --help and shell completion answer without it
    from ampctl.studies.inspect_ranges import run_inspect

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    with refused_in_one_line("inspect", out_dir):
        run_inspect(job_of("inspect", cfg, hydra_cfg).cfg, out_dir, task_overrides(hydra_cfg))
