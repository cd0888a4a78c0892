"""What the study commands (compare, memory, inspect, advise) share around their study: the study as both front
ends hand it over, its Hydra app made from its record's run (study_app), and its ways out."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from omegaconf import DictConfig

from ampctl.errors import SomeRunsFailed, UsageError
from ampctl.interrupt import Interrupted, StoppedOnSignal, interrupts_surfaced, signal_name
from ampctl.shell.outcomes import leave


@dataclass(frozen=True)
class Study:
    """A study as both its front ends hand it over: the command line's Hydra app and its Python API function."""

    cfg: DictConfig  # the study's config, typed and checked
    out_dir: Path  # its directory (Hydra's run directory)
    overrides: list[str]  # the command line's overrides as typed (each run the study starts gets them)
    config_dir: Optional[str]  # the command line's -cd, so that every process the study starts sees the same configs


# A study's run: the number of its runs that failed (named in its table), or None
StudyRunner = Callable[[Study], Optional[int]]


def command_line_config_dir(hydra_cfg: DictConfig) -> Optional[str]:
    """The -cd directory, if any, so that every mode's process sees the same configs."""
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            return source.path
    return None


def study_app(command: str, run: StudyRunner, interrupted_means: str = "",
              stopped_with: str = "") -> Callable[[], None]:
    """`ampctl <command>`'s Hydra app over conf/<command>.yaml: the plan its check made, run; its refusal and a stop
    signal it did not handle said in one line (interrupted_means: what the command adds where something was); a
    stop its study handled (a comparison's runs stopped with their checkpoints) said with `stopped_with` (where
    what was measured is: `{out_dir}` is the study's directory); runs that failed: exit 1, after the table."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    def task(cfg: DictConfig) -> None:
        from ampctl.shell.plans import plan_of, task_overrides

        hydra_cfg = HydraConfig.get()
        out_dir = Path(hydra_cfg.runtime.output_dir)
        try:
            with refused_in_one_line(command, out_dir, interrupted_means):
                failed = run(Study(plan_of(command, cfg, hydra_cfg).cfg, out_dir, task_overrides(hydra_cfg),
                                      command_line_config_dir(hydra_cfg)))
        except StoppedOnSignal as exc:
            leave(exc, [f"ampctl {command}: interrupted ({exc}); {stopped_with.format(out_dir=out_dir)}"])
        if failed:
            leave(SomeRunsFailed(failed), [])  # the study's table says which runs failed and why

    task.__name__ = task.__qualname__ = command
    return hydra.main(version_base=None, config_path="pkg://ampctl.conf", config_name=command)(task)


@contextlib.contextmanager
def refused_in_one_line(command: str, out_dir: Path, interrupted_means: str = "") -> Iterator[None]:
    """A study's refusal: one line, exit code 2, and its directory gone if it holds only Hydra's files. A stop
    signal the study did not handle itself: one line that says whether anything was measured (and where), the
    directory gone if nothing was; interrupted_means: what the command adds when something was. (Exit codes and
    clean-up: shell/outcomes.py.)"""
    try:
        with interrupts_surfaced():
            yield
    except UsageError as exc:
        leave(exc, [f"ampctl {command}: error: {exc}"], out_dir)
    except (KeyboardInterrupt, Interrupted) as exc:  # Interrupted: a run the study trained itself stopped
        name = signal_name(exc)

        def said() -> list[str]:  # after the clean-up: whether the directory is still there says what was measured
            if out_dir.is_dir():
                return [f"\nampctl {command}: interrupted ({name}); what was measured until then is in "
                        f"{out_dir}{interrupted_means}"]
            return [f"\nampctl {command}: interrupted ({name}) before anything was recorded"]

        leave(exc, said, out_dir)
