"""`ampctl advise [overrides]`: a Hydra app over conf/advise.yaml (train's config plus advise.*, and the settings
of the compare and inspect studies it runs)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ampctl.commands.compare import command_line_config_dir
from ampctl.shell.checks import job_of, task_overrides
from ampctl.shell.outcomes import leave
from ampctl.shell.studies import refused_in_one_line


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="advise")
def advise(cfg: DictConfig) -> None:
    # the study imports torch: here, so that --help and shell completion answer without it
    from ampctl.studies.advise import run_advise
    from ampctl.studies.compare import CompareInterrupted

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        with refused_in_one_line("advise", out_dir, " (nothing was compared yet: no advice)"):
            run_advise(job_of("advise", cfg, hydra_cfg).cfg, out_dir, task_overrides(hydra_cfg),
                       command_line_config_dir(hydra_cfg))
    except CompareInterrupted as exc:
        leave(exc, [f"ampctl advise: interrupted ({exc}); the advice of what was measured is in {out_dir}"])
