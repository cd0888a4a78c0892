"""ampctl from Python (a notebook, a script): the same configs, overrides and checks as the command line, and
the result back as a value.

    import ampctl

    run = ampctl.train(["recipe=mlp", "precision=bf16", "train.steps=100"])
    run.summary["final_loss"], run.run_dir
    table = ampctl.compare(["recipe=mlp", "train.steps=50", "compare.precisions=[fp32,bf16]"])
    ranges = ampctl.inspect(["recipe=mlp", "precision=fp16"])
    memory = ampctl.memory(["recipe=gpt", "memory.precisions=[fp32,bf16]"])
    served = ampctl.export(run.run_dir, ["export.dtype=bfloat16"])

Overrides are Hydra's, as typed after the command (`key=value`, `group=option`); `config_dir` is the command
line's `-cd` (your own configs and recipes), `config_name` its `-cn`. A bad value raises
ampctl.errors.UsageError with the one line the command line would print; a run that a guard stopped raises
ampctl.errors.RunStopped. Each call writes the directory the command would (`run_dir`/`out_dir` to choose it).
A sweep (`-m`) stays the command line's: call train() once per setting instead.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files

if TYPE_CHECKING:
    from ampctl.shell.checks import Job

PathLike = Union[str, Path]


@dataclass(frozen=True)
class Result:
    """What a call leaves: its directory and its record (train: summary.json; compare: comparison.json;
    inspect: ranges.json; memory: memory.json), the same files `ampctl report` reads."""

    run_dir: Path
    summary: dict[str, Any]


def train(overrides: Sequence[str] = (), *, run_dir: Optional[PathLike] = None,
          config_dir: Optional[PathLike] = None, config_name: str = "train") -> Result:
    """`ampctl train [overrides]`: one training run; returns its summary and run directory."""
    from ampctl.runner.run import run_training

    with _command("train", config_name, overrides, run_dir, config_dir) as (job, _hydra_cfg, out):
        summary = run_training(job)
    return Result(Path(summary["run_dir"]), summary)


def compare(overrides: Sequence[str] = (), *, out_dir: Optional[PathLike] = None,
            config_dir: Optional[PathLike] = None, config_name: str = "compare") -> Result:
    """`ampctl compare [overrides]`: the same run under several precision modes; returns comparison.json."""
    from ampctl.shell.checks import task_overrides
    from ampctl.studies.compare import run_compare

    with _command("compare", config_name, overrides, out_dir, config_dir) as (job, hydra_cfg, out):
        run_compare(job.cfg, out, task_overrides(hydra_cfg), _dir(config_dir))
    return Result(out, json.loads((out / f"{run_files.COMPARISON}.json").read_text()))


def inspect(overrides: Sequence[str] = (), *, out_dir: Optional[PathLike] = None,
            config_dir: Optional[PathLike] = None, config_name: str = "inspect") -> Result:
    """`ampctl inspect [overrides]`: where values fall against each format's range; returns ranges.json."""
    from ampctl.shell.checks import task_overrides
    from ampctl.studies.inspect_ranges import run_inspect

    with _command("inspect", config_name, overrides, out_dir, config_dir) as (job, hydra_cfg, out):
        run_inspect(job.cfg, out, task_overrides(hydra_cfg))
    return Result(out, json.loads((out / f"{run_files.INSPECTION}.json").read_text()))


def memory(overrides: Sequence[str] = (), *, out_dir: Optional[PathLike] = None,
           config_dir: Optional[PathLike] = None, config_name: str = "memory") -> Result:
    """`ampctl memory [overrides]`: estimated memory per part next to the measured peak; returns memory.json."""
    from ampctl.shell.checks import task_overrides
    from ampctl.studies.memory import run_memory

    with _command("memory", config_name, overrides, out_dir, config_dir) as (job, hydra_cfg, out):
        run_memory(job.cfg, out, task_overrides(hydra_cfg), _dir(config_dir))
    return Result(out, json.loads((out / f"{run_files.MEMORY}.json").read_text()))


def export(path: PathLike, overrides: Sequence[str] = ()) -> Result:
    """`ampctl export PATH [export.dtype=... ...]`: a checkpoint's weights (PATH: a run directory or a checkpoint)
    in the dtype you serve; returns the export's directory and its export.json."""
    from ampctl.conf.export_schema import ExportConfig
    from ampctl.runner.export import RECORD
    from ampctl.runner.export import export as export_checkpoint

    exported = export_checkpoint(Path(path), ExportConfig.from_overrides(list(overrides)), say=lambda _line: None)
    return Result(exported.path, json.loads((exported.path / RECORD).read_text()))


def _dir(config_dir: Optional[PathLike]) -> Optional[str]:
    return None if config_dir is None else str(Path(config_dir).resolve())


@contextlib.contextmanager
def _command(command: str, config_name: str, overrides: Sequence[str], out: Optional[PathLike],
             config_dir: Optional[PathLike]) -> Iterator[tuple["Job", DictConfig, Path]]:
    """The job (its checked config as it runs), the hydra node and the output directory, as the command's Hydra
    app has them, after the command line's checks (its values; an output directory that is not its own is refused before
    anything is written). The directory gets Hydra's .hydra/ files (config, overrides), which reports read. A
    refused call leaves no directory, as on the command line (a run that recorded steps keeps them)."""
    from ampctl.conf.composing import without_hydra_node
    from ampctl.conf.messages import one_line
    from ampctl.errors import UsageError
    from ampctl.runner.ownership import remove_if_only_hydra_files
    from ampctl.shell.checks import check_single_run, task_overrides
    from ampctl.shell.hydra_internals import composed, put_config_dir_on_path

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
        job = check_single_run(command, cfg)
        out_dir = Path(cfg.hydra.run.dir)
        (out_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        io.atomic_write_text(out_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(without_hydra_node(cfg)))
        io.atomic_write_text(out_dir / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(task_overrides(cfg.hydra)))
        try:
            yield job, cfg.hydra, out_dir
        except UsageError:
            remove_if_only_hydra_files(out_dir)
            raise
