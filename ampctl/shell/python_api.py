"""What every command's Python API function shares (ampctl/api.py's): the command's config composed, checked and its
directory made as the command line's Hydra app would, and the Result it returns. A study's function is made from
its record's run (study_api), as its Hydra app is (shell/studies.study_app)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.shell.result import Result

if TYPE_CHECKING:
    from ampctl.shell.plan_kinds import Plan
    from ampctl.shell.studies import Study

PathLike = Union[str, Path]


def config_dir_given(config_dir: Optional[PathLike]) -> Optional[str]:
    return None if config_dir is None else str(Path(config_dir).resolve())


def study_api(command: str, run: Callable[["Study"], Optional[int]], record: str,
              summary: str) -> Callable[..., Result]:
    """`ampctl.<command>(overrides, out_dir=, config_dir=, config_name=)`: the study run as its command runs it;
    returns its directory and its record (`<record>.json`)."""
    from ampctl.shell.studies import Study

    def api(overrides: Sequence[str] = (), *, out_dir: Optional[PathLike] = None,
            config_dir: Optional[PathLike] = None, config_name: str = command) -> Result:
        from ampctl.shell.plans import task_overrides

        with planned_run(command, config_name, overrides, out_dir, config_dir) as (plan, hydra_cfg, out):
            run(Study(plan.cfg, out, task_overrides(hydra_cfg), config_dir_given(config_dir)))
        return Result(out, json.loads((out / f"{record}.json").read_text()))

    api.__name__ = api.__qualname__ = command
    api.__doc__ = f"`ampctl {command} [overrides]`: {summary}; returns {record}.json."
    return api


@contextlib.contextmanager
def planned_run(command: str, config_name: str, overrides: Sequence[str], out: Optional[PathLike],
              config_dir: Optional[PathLike]) -> Iterator[tuple["Plan", DictConfig, Path]]:
    """The plan (its checked config as it runs), the hydra node and the output directory, as the command's Hydra
    app has them, after the command line's checks (its values; an output directory that is not its own is refused before
    anything is written). The directory gets Hydra's .hydra/ files (config, overrides), which reports read. A
    refused call leaves no directory, as on the command line (a run that recorded steps keeps them)."""
    from ampctl.conf.composing import without_hydra_node
    from ampctl.conf.messages import one_line
    from ampctl.errors import UsageError
    from ampctl.runner.ownership import remove_if_only_hydra_files
    from ampctl.shell.hydra_internals import composed, put_config_dir_on_path
    from ampctl.shell.plans import plan_a_single_run, task_overrides

    if isinstance(overrides, (str, bytes)):  # "recipe=mlp" would be read as the overrides r, e, c, ...
        raise UsageError(f"overrides={overrides!r}: expected a list of overrides, e.g. [{overrides!r}]")
    not_text = next((o for o in overrides if not isinstance(o, str)), None)
    if not_text is not None:  # ampctl.train([123]) said "'int' object is not iterable"
        raise UsageError(f"overrides: {not_text!r} ({type(not_text).__name__}) is not a string: each override is "
                         "key=value, e.g. 'train.steps=100'")
    flags = [o for o in overrides if str(o).startswith("-")]
    if flags:  # -m, -cd, --cfg: the command line's flags, not overrides
        raise UsageError(f"{flags[0]!r}: ampctl.{command}() takes overrides only (key=value); a sweep (-m) is the "
                         f"command line's, config_dir= and config_name= are -cd and -cn")
    overrides = [*overrides, *([f"hydra.run.dir={out}"] if out is not None else [])]
    if config_dir is not None:
        if not Path(config_dir).is_dir():
            raise UsageError(f"config_dir={str(config_dir)!r} is not a directory: expected the directory of your "
                             "configs (the command line's -cd)")
        put_config_dir_on_path(["-cd", str(config_dir)])
    with contextlib.ExitStack() as hydra:
        try:
            given_dir = None if config_dir is None else Path(config_dir)
            cfg = hydra.enter_context(composed(config_name, overrides, given_dir))
        except Exception as exc:  # Hydra's and OmegaConf's multi-line errors, as the command line's one line
            raise UsageError(one_line(exc)) from None
        plan = plan_a_single_run(command, cfg)
        out_dir = Path(cfg.hydra.run.dir)
        (out_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        io.atomic_write_text(out_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(without_hydra_node(cfg)))
        io.atomic_write_text(out_dir / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(task_overrides(cfg.hydra)))
        try:
            yield plan, cfg.hydra, out_dir
        except UsageError:
            remove_if_only_hydra_files(out_dir)
            raise
