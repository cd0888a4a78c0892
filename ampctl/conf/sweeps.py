"""The jobs of a Hydra multirun, from its config, through Hydra's public override parser.

Sweeps are expanded only for Hydra's basic sweeper (a list or range per key); another sweeper (Optuna, Ax,
Nevergrad) chooses its jobs as it goes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from ampctl.conf.migration import migrated_override

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # the default's _target_, a name only

# A stop asked of every job of a sweep by its launcher's process, in the sweep's directory: Ctrl-C ends the
# launcher's wait, but its signal never reaches jobs that run elsewhere (a Ray worker, a SLURM node). Each job's
# loop looks for it (at most once a second) and stops as on that signal, with its checkpoint. Written by the
# command that launched the sweep, removed when the sweep starts again.
STOP_REQUEST = ".ampctl-stop"


def request_stop(sweep_dir: Path, signal_name: str) -> None:
    if sweep_dir.is_dir():
        (sweep_dir / STOP_REQUEST).write_text(signal_name + "\n", encoding="utf-8")


def clear_stop_request(sweep_dir: Path) -> None:
    (sweep_dir / STOP_REQUEST).unlink(missing_ok=True)


def stop_requested_of_this_job() -> Optional[Path]:
    """The stop request file of the sweep this process runs a job of (None outside a sweep's job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir) / STOP_REQUEST


def sweep_overrides(config: DictConfig) -> list[str]:
    """The overrides the sweeper expands: `hydra.sweeper.params` from the config, then the command line's."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()] + [str(o) for o in config.hydra.overrides.task]


def expand(overrides: list[str]) -> Optional[list[list[str]]]:
    """Every job's overrides, as Hydra's basic sweeper forms them (the product of each key's values, a later
    value of a key replacing an earlier one); None when a sweep is not a list (interval(), a tag)."""
    values: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            return None
    return [list(job) for job in itertools.product(*values.values())]


def base_overrides(overrides: list[str]) -> list[str]:
    """The overrides every job shares: the command line without its sweeps."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [text for text, override in zip(overrides, parsed) if not override.is_sweep_override()]


def planned_jobs(config: DictConfig) -> Optional[list[list[str]]]:
    """The jobs of this multirun, when the sweeper is Hydra's basic one; None when a plugin chooses them."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    return expand(sweep_overrides(config))


# --- a sweep's identity, and the command that continues it --------------------------------------------------------

SWEEP_RECORD = "multirun.yaml"  # Hydra's record of the sweep's config in its directory (the launcher writes it)


def apart_from_resume(overrides: list[str]) -> list[str]:
    """A sweep's overrides as they identify it: all but resume=, which says how it starts, not what it runs."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "resume"]


# Hydra overrides its continue command sets itself (the sweep's directory) or Hydra adds (the mode)
PLACED_BY_THE_COMMAND = ("hydra.sweep.dir=", "hydra.run.dir=", "hydra.mode=")


@dataclass(frozen=True)
class SweepIdentity:
    """What makes two command lines the same sweep: the primary config (and -cd directory) and the overrides,
    resume= apart (their order does not matter)."""

    config_name: str
    config_dir: Optional[str]
    overrides: tuple[str, ...] = field(compare=False)  # as typed
    matched: tuple[str, ...] = ()  # what two sweeps are compared on: the overrides in any order
    # Hydra's own overrides that say how it ran (hydra/launcher=submitit_slurm, hydra.launcher.*): its continue
    # command keeps them; not compared (a sweep may go on under another launcher)
    launch: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matched", tuple(sorted(self.overrides)))

    @classmethod
    def of(cls, config: DictConfig) -> "SweepIdentity":
        """From a multirun's config with its hydra node (the one Hydra records as multirun.yaml)."""
        hydra = config.hydra
        task = [str(o) for o in OmegaConf.to_container(hydra.overrides.task, resolve=False)]  # type: ignore[union-attr]
        sources = OmegaConf.to_container(hydra.runtime.config_sources, resolve=False) or []
        config_dir = next((s["path"] for s in sources if s.get("provider") == "command-line"), None)  # type: ignore[union-attr]
        given = [str(o) for o in OmegaConf.to_container(hydra.overrides.hydra, resolve=False) or []]  # type: ignore[union-attr]
        launch = tuple(o for o in given if not o.startswith(PLACED_BY_THE_COMMAND))
        return cls(str(hydra.job.config_name), config_dir, tuple(apart_from_resume(task)), launch=launch)

    @classmethod
    def recorded(cls, sweep_dir: Path) -> Optional["SweepIdentity"]:
        """The identity of the sweep recorded in sweep_dir, its overrides in today's config layout (a sweep started
        before train.* was grouped continues: conf/migration.py); None where there is none (or it cannot be read)."""
        try:
            recorded = cls.of(OmegaConf.load(sweep_dir / SWEEP_RECORD))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - not a sweep's record: no identity to match
            return None
        return cls(recorded.config_name, recorded.config_dir,
                   tuple(migrated_override(o) for o in recorded.overrides), launch=recorded.launch)

    def words(self) -> str:
        return " ".join(self.overrides) or "(no overrides)"

    def command(self, sweep_dir: Path) -> str:
        """The command that continues this sweep in sweep_dir: its own command line, with resume=auto."""
        import shlex

        flags = [*(["-cd", self.config_dir] if self.config_dir else []),
                 *(["-cn", self.config_name] if self.config_name != "train" else [])]
        return shlex.join(["ampctl", "train", "-m", *flags, *self.launch, *self.overrides, "resume=auto",
                           f"hydra.sweep.dir={sweep_dir}"])
