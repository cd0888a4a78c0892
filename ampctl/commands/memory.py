"""`ampctl memory [overrides]`: a Hydra app over ampctl/conf/memory.yaml (train's config plus memory.*)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ampctl.commands.compare import command_line_config_dir
from ampctl.shell.checks import job_of, task_overrides
from ampctl.shell.studies import refused_in_one_line


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="memory")
def memory(cfg: DictConfig) -> None:
    # the study imports torch: here, so that --help and shell completion answer without it
    from ampctl.studies.memory import run_memory

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    with refused_in_one_line("memory", out_dir):
        run_memory(job_of("memory", cfg, hydra_cfg).cfg, out_dir, task_overrides(hydra_cfg),
                   command_line_config_dir(hydra_cfg))
