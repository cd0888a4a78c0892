"""Where a config was composed from, beyond ampctl's own: the user's config directories (`-cd`, and any
`hydra.searchpath` of theirs) and the directory their recipe's module is imported from. A config ampctl writes
(repaired.yaml, advised.yaml, a `--cfg job` dump) names them in Hydra's own key, `hydra.searchpath`, so that it runs
as printed from any directory; and modules beside a config directory are importable, as those of a script's own
directory are (a recipe's `_target_: my_recipe.Recipe` without PYTHONPATH)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, OmegaConf

FILE = "file://"


def user_config_dirs(hydra_node: DictConfig) -> list[str]:
    """The composed config's file:// sources, absolute, in their search order: `-cd`, then hydra.searchpath's
    (ampctl's own configs are pkg://, Hydra's too)."""
    sources = OmegaConf.select(hydra_node, "runtime.config_sources") or []
    return list(dict.fromkeys(str(Path(source.path).resolve()) for source in sources
                              if source.schema == "file" and source.path))


def recipe_module_dir(job: DictConfig) -> Optional[str]:
    """The directory the recipe's module is found in, where only this process finds it there: the working
    directory or a PYTHONPATH entry (docs/models.md's `PYTHONPATH=. ampctl train -cd my_conf ...`). An installed
    package, ampctl's own recipes included, is found from anywhere: None."""
    target = OmegaConf.select(job, "recipe._target_")
    if not isinstance(target, str) or "." not in target:
        return None
    top = target.split(".", 1)[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    root = origin.parent.parent if origin.name == "__init__.py" else origin.parent
    path_entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    found_only_here = {Path(os.getcwd()).resolve(), *(Path(entry).resolve() for entry in path_entries)}
    return str(root) if root in found_only_here else None


def searchpath_of(job: DictConfig) -> list[str]:
    """What a written config needs in hydra.searchpath to compose and run again from any directory (job: the
    composed config with its hydra node)."""
    dirs = user_config_dirs(job.hydra)
    module_dir = recipe_module_dir(job)
    if module_dir is not None and module_dir not in dirs:
        dirs.append(module_dir)
    return [FILE + d for d in dirs]


def make_importable(dirs: Iterable[str]) -> None:
    """Modules in these directories importable here and in the processes this one starts (compare's, memory's)."""
    for directory in reversed([os.path.abspath(d) for d in dirs if os.path.isdir(d)]):
        if directory not in sys.path:
            sys.path.insert(0, directory)
        inherited = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
        if directory not in inherited:
            os.environ["PYTHONPATH"] = os.pathsep.join([directory, *inherited])
