"""`ampctl compare [overrides]`: a Hydra app over ampctl/conf/compare.yaml (train's config plus compare.*)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ampctl.errors import SomeRunsFailed
from ampctl.shell.checks import job_of, task_overrides
from ampctl.shell.outcomes import leave
from ampctl.shell.studies import refused_in_one_line


def command_line_config_dir(hydra_cfg: DictConfig) -> str | None:
    """The -cd directory, if any, so that every mode's process sees the same configs."""
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            return source.path
    return None


@hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name="compare")
def compare(cfg: DictConfig) -> None:
    # the study imports torch: here, so that --help and shell completion answer without it
    from ampctl.studies.compare import CompareInterrupted, run_compare

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        with refused_in_one_line("compare", out_dir):
            failed = run_compare(job_of("compare", cfg, hydra_cfg).cfg, out_dir, task_overrides(hydra_cfg),
                                 command_line_config_dir(hydra_cfg))
    except CompareInterrupted as exc:
        leave(exc, [f"ampctl compare: interrupted ({exc}); the modes run so far are compared in {out_dir} (each "
                    "interrupted mode's line above says whether and how it continues)"])
    if failed:
        leave(SomeRunsFailed(failed), [])  # the table says which modes failed and why
