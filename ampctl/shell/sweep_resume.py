"""`ampctl train -m ... resume=auto` without hydra.sweep.dir: the sweep it continues.

Hydra's default sweep directory is a new time-stamped one (`multirun/<date>/<time>`), so the same command plus
resume=auto would start the sweep over in a directory of its own. Before Hydra runs, such a command line is given
the `hydra.sweep.dir=` of the newest unfinished sweep of the same command (its config and overrides, resume=
apart) under the sweep root (hydra.sweep.dir up to its first interpolation), said in one line; where there is none,
it is refused in one line. A sweep is unfinished until its report (sweep.json) lists every job as ok.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from ampctl.conf.sweeps import SWEEP_RECORD, SweepIdentity, apart_from_resume, base_overrides
from ampctl.errors import UsageError
from ampctl.shell.hydra_internals import composed, hydra_flags

SWEEP_REPORT = "sweep.json"  # written when a sweep ends (reports/sweep.py): each job's status
NOT_A_SWEEP = {"help", "hydra_help", "cfg", "info", "shell_completion"}


def with_the_sweep_to_continue(args: list[str]) -> list[str]:
    """args, with `hydra.sweep.dir=<the sweep>` added where a multirun asks resume=auto without naming its
    directory (UsageError where no sweep of this command is unfinished); otherwise args as they are."""
    flags, overrides = hydra_flags(args)
    if ("multirun" not in flags or NOT_A_SWEEP & set(flags) or "resume=auto" not in overrides
            or any(o.startswith("hydra.sweep.dir=") for o in overrides)):
        return args
    name = flags.get("config_name") or "train"
    config_dir = flags.get("config_dir")
    with composed(name, base_overrides(overrides), Path(config_dir) if config_dir else None) as cfg:
        pattern = str(OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["dir"])  # type: ignore[index]
        sources = OmegaConf.to_container(cfg.hydra.runtime.config_sources, resolve=False) or []
    if "${" not in pattern:
        return args  # one fixed directory: the sweep is there, or there is none to continue
    wanted = SweepIdentity(name, next((s["path"] for s in sources if s.get("provider") == "command-line"), None),
                           tuple(apart_from_resume(overrides)))
    root, depth = sweep_root(pattern)
    found = newest_unfinished(root, depth, wanted)
    if found is None:
        raise UsageError(f"resume=auto: no unfinished sweep of this command ({wanted.words()}) under {root}/: give "
                         "hydra.sweep.dir=<the sweep> to continue one, or leave out resume=auto to start a new sweep")
    print(f"ampctl train: resume=auto continues the newest unfinished sweep of this command: {found}", flush=True)
    return [*args, f"hydra.sweep.dir={found}"]


def sweep_root(pattern: str) -> tuple[Path, int]:
    """hydra.sweep.dir's fixed part (`multirun/${now:...}/${now:...}` -> multirun) and the levels below it."""
    head = pattern[:pattern.index("${")]
    root = head[:head.rfind("/")] if "/" in head else ""
    return Path(root or "."), pattern[len(root):].strip("/").count("/") + 1


def newest_unfinished(root: Path, depth: int, wanted: SweepIdentity) -> Optional[Path]:
    """The most recently started (or continued) sweep under root, at that depth, of this identity and not
    finished."""
    if not root.is_dir():
        return None
    sweeps = [d for d in root.glob("/".join(["*"] * depth)) if (d / SWEEP_RECORD).is_file()]
    ours = [d for d in sweeps if SweepIdentity.recorded(d) == wanted and unfinished(d)]
    return max(ours, key=lambda d: (d / SWEEP_RECORD).stat().st_mtime, default=None)


def unfinished(sweep_dir: Path) -> bool:
    """Whether a sweep has a job left to run: no report yet (it was stopped), or a job in it that is not ok."""
    try:
        rows = json.loads((sweep_dir / SWEEP_REPORT).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return any(row.get("status") != "ok" for row in rows)
