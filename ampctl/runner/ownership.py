"""A run directory belongs to one run: a new run never writes into another's, and a resumed run that finds
rows without a checkpoint (a run killed before its first) starts clean, the old rows set aside."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import yaml

from ampctl import io, run_files
from ampctl.conf.sweeps import SWEEP_RECORD, SweepIdentity
from ampctl.errors import UsageError
from ampctl.reports.runs import flock_run_dir, holder_pid
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.checkpointing.best_checkpoints import read_index, set_aside_after
from ampctl.runner.checkpointing.checkpoint_files import checkpoint_step, is_checkpoint, list_checkpoints, run_dir_of
from ampctl.runner.identity import created_here


def run_records(run_dir: Path) -> list[str]:
    """The records of a run already in run_dir (its checkpoints included)."""
    found = [name for name in run_files.RECORDS if (run_dir / name).is_file()]
    if (run_dir / run_files.CHECKPOINTS).is_dir() and any((run_dir / run_files.CHECKPOINTS).iterdir()):
        found.append(f"{run_files.CHECKPOINTS}/")
    return found


def is_leftover(path: Path, logs: Optional[set[str]] = None) -> bool:
    """Whether path is what a command that recorded nothing leaves in its directory: Hydra's files, the lock, an
    empty metrics.jsonl, or the command's log (`logs`: job_logs(its directory), read once for a directory's files)."""
    empty_metrics = path.name == run_files.METRICS and path.is_file() and not path.stat().st_size
    logs = job_logs(path.parent) if logs is None else logs
    return path.name in run_files.LEFTOVERS or path.name in logs or empty_metrics


def job_logs(directory: Path) -> set[str]:
    """The logs of the commands that ran in directory: Hydra's job logging writes <hydra.job.name>.log (the
    command's name: each command's YAML sets it), as the directory's .hydra/hydra.yaml records it, and as this
    process's own log handlers name it (Hydra opens the log before it writes hydra.yaml: a command stopped between
    the two has only its handler to say so)."""
    logs = {Path(handler.baseFilename).name for handler in logging.getLogger().handlers
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == directory.resolve()}
    try:
        recorded = yaml.safe_load((directory / run_files.HYDRA / "hydra.yaml").read_text())
        logs.add(f"{recorded['hydra']['job']['name']}.log")
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        pass
    return logs


def what_it_holds(directory: Path) -> list[str]:
    """What directory holds beyond the leftovers of a command that recorded nothing (folders end in /)."""
    if not directory.is_dir():
        return []
    logs = job_logs(directory)
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir() if not is_leftover(p, logs))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


# scheme://: a URL (s3://, gs://, memory://, file://), which pathlib would take for a relative path ("s3:/bucket")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _a_directory(key: str, value: str, what: str) -> Path:
    """The directory a key names, refused when it is empty (the current directory), a URL or names a file."""
    if not str(value).strip():
        raise UsageError(f"{key}='' is not allowed: expected a directory of its own for this {what} (the current "
                         "directory is not one)")
    if _URL.match(str(value)):
        raise UsageError(f"{key}={value} is a URL: expected a local directory (or one on a file system every node "
                         f"mounts) for this {what}; ampctl writes and renames its files there")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{key}={value} is a file, not a directory: choose a directory for this {what}")
    return path


def continues_here(resume: Optional[str], run_dir: Path) -> bool:
    """Whether resume= continues the run in run_dir itself (auto, or a checkpoint or directory of it)."""
    if not resume:
        return False
    if resume == "auto":
        return True
    target = Path(resume).expanduser()
    owner = run_dir_of(target) if target.is_file() or is_checkpoint(target) else target
    return owner.resolve() == run_dir.resolve()


# The names a run keeps as directories; every other name of its own is a file
RUN_OWN_DIRECTORIES = frozenset({run_files.CHECKPOINTS, run_files.HYDRA})


def refuse_damaged_names(run_dir: Path) -> None:
    """A name the run keeps as a directory that is a file there (checkpoints/), or one it keeps as a file that is a
    directory (.ampctl.lock, metrics.jsonl): the directory is not the run's as it wrote it, and writing into it would
    fail half-way. Refused before anything is moved or written."""
    for name in sorted(run_files.RUN_OWN_NAMES - {"profile", "wandb"}):
        path = run_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        want_dir = name in RUN_OWN_DIRECTORIES
        if path.is_dir() != want_dir:
            what, kept = ("a file", "a directory") if want_dir else ("a directory", "a file")
            raise UsageError(f"hydra.run.dir={run_dir}: {name} is {what}, where an ampctl run keeps {kept}: the run "
                             "directory is damaged; move it aside or choose another hydra.run.dir (nothing in it was "
                             "changed)")


def refuse_another_runs_directory(run_dir: str, resume: Optional[str]) -> None:
    """Checked before Hydra creates or writes into the run directory (its .hydra/ would be overwritten): a new
    run (resume unset or empty) only into a directory of its own; a resume only into the run it continues."""
    path = _a_directory("hydra.run.dir", run_dir, "run's records")
    refuse_damaged_names(path)
    refuse_a_directory_in_use(path)
    held = what_it_holds(path)
    if not held:
        return
    if continues_here(resume, path):
        if (path / run_files.IDENTITY).is_file():
            return
        records = run_records(path)
        if records and not list_checkpoints(path):
            # identity.json is written before a run's first record: records without it are a damaged run (or
            # one made before identities and killed before its first checkpoint), with nothing to continue
            raise UsageError(f"hydra.run.dir={run_dir} holds a run's records ({_listed(records)}) but neither its "
                             f"{run_files.IDENTITY} nor a checkpoint: there is nothing to continue it from, and a "
                             "resume would train another run among its records; start a new run in another "
                             "hydra.run.dir")
        if records:
            return  # its checkpoints decide: made before identities, or one that lost it (checkpointing/checkpoint.py)
        raise UsageError(f"hydra.run.dir={run_dir} holds no ampctl train run to resume ({_listed(held)}): "
                         "choose the run's own directory, or a new one")
    raise UsageError(f"hydra.run.dir={run_dir} already holds "
                     + (f"a run ({_listed(held)}): continue it with resume=auto, or choose another hydra.run.dir"
                        if (path / run_files.IDENTITY).is_file() or run_records(path) else
                        f"files of its own ({_listed(held)}): a run writes only into a directory of its own; "
                        "choose another hydra.run.dir"))


def refuse_another_commands_directory(command: str, out_dir: str) -> None:
    """compare, inspect, memory: their output directory is theirs alone (absent, empty, or the leftovers of a
    command that recorded nothing), checked before Hydra writes into it."""
    path = _a_directory("hydra.run.dir", out_dir, f"{command}'s records")
    refuse_a_directory_in_use(path)
    held = what_it_holds(path)
    if held:
        raise UsageError(f"hydra.run.dir={out_dir} is not empty ({_listed(held)}): ampctl {command} writes only "
                         "into a directory of its own, never over earlier results; choose another hydra.run.dir")


def refuse_another_sweeps_directory(sweep_dir: str, resume: Optional[str], identity: SweepIdentity) -> None:
    """A multirun into a sweep directory that holds another sweep (or anything else) would write its jobs
    beside (or into) the other's: refused before Hydra's sweeper creates or writes anything. A sweep with
    resume=auto continues its own, the same sweep (its config and overrides, resume= apart): finished jobs
    kept, the others resumed (commands/train.py)."""
    path = _a_directory("hydra.sweep.dir", sweep_dir, "sweep's jobs")
    held = what_it_holds(path)
    if not held:
        return
    if resume == "auto" and (path / SWEEP_RECORD).is_file():
        theirs = SweepIdentity.recorded(path)
        if theirs == identity:
            return
        raise UsageError(
            f"hydra.sweep.dir={sweep_dir} holds another sweep ("
            + (f"{theirs.words()}" + (f", -cn {theirs.config_name}" if theirs.config_name != identity.config_name
                                      else "") if theirs is not None else f"its {SWEEP_RECORD} cannot be read")
            + f"), not this one ({identity.words()}): resume=auto continues only the same sweep; choose another "
            "hydra.sweep.dir" + (f", or continue that one with: {theirs.command(path)}" if theirs is not None else ""))
    jobs = [p for p in path.iterdir() if p.is_dir() and (run_records(p) or (p / run_files.IDENTITY).is_file())]
    raise UsageError(f"hydra.sweep.dir={sweep_dir} already holds "
                     + (f"a sweep ({len(jobs)} job directories with records): continue it with resume=auto, or "
                        "choose another hydra.sweep.dir" if (path / SWEEP_RECORD).is_file() else
                        f"files of its own ({_listed(held)}): choose another hydra.sweep.dir"))


def _in_use(run_dir: Path, pid: Optional[int]) -> UsageError:
    holder = f" (pid {pid})" if pid is not None and pid > 0 else ""
    return UsageError(f"hydra.run.dir={run_dir} is in use by another ampctl run{holder}: "
                      "wait for it to end, or choose another hydra.run.dir")


def refuse_a_directory_in_use(run_dir: Path) -> None:
    """Before Hydra writes into run_dir: refused if a running ampctl holds its lock."""
    pid = holder_pid(run_dir)
    if pid is not None:
        raise _in_use(run_dir, pid)


# The run directories this process holds: a hold inside another of the same directory is part of it (the command
# holds its run's directory until it has said its last line, around the runner's own hold)
_held: set[Path] = set()


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold run_dir for this run: a second run into it, even with resume=, is refused while this one lives. An
    advisory flock: released by the kernel when the process ends, however it ends, so a killed run leaves
    no stale lock (only the file, which the next run takes over). Within a hold of the same directory by this
    process, nothing more: the outer one releases it."""
    key = run_dir.resolve()
    if key in _held:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / run_files.LOCK, "a+")
    try:
        try:
            flock_run_dir(handle, fcntl.LOCK_EX | fcntl.LOCK_NB, run_dir)
        except BlockingIOError:
            raise _in_use(run_dir, holder_pid(run_dir)) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
    except BaseException:
        handle.close()
        raise
    _held.add(key)
    try:
        yield
    finally:
        _held.discard(key)
        (run_dir / run_files.LOCK).unlink(missing_ok=True)  # a run that ended, however, leaves no lock file
        handle.close()  # closing releases the lock


def set_aside_rows_without_checkpoint(run_dir: Path) -> list[Path]:
    """resume=auto found no checkpoint: a run killed before its first left rows that no state continues.
    They are moved to `<name>.set-aside-<time>` (kept, never deleted) so that this run starts at step 1."""
    if list_checkpoints(run_dir):
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return [path.rename(_aside(path, stamp)) for path in map(run_dir.joinpath, run_files.RECORDS) if path.is_file()]


def _aside(path: Path, stamp: str) -> Path:
    """A free name beside path for what is set aside: `<name>.set-aside-<time>` (-2, -3... within a second)."""
    target, n = path.with_name(f"{path.name}.set-aside-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.set-aside-{stamp}-{n}")
    return target


def start_timeline_at(run_dir: Path, step: int) -> list[str]:
    """Resuming at `step`: what the directory holds past it is set aside, never deleted, so that the run goes
    on from `step` without duplicated rows, and a later resume=auto cannot jump back to another timeline:
    rows a killed run wrote after its checkpoint, or everything after an older checkpoint resumed on purpose
    (later rows and checkpoints). The summary and diagnosis describe an end this run will write again.
    Returns one line per thing set aside."""
    stamp, said = time.strftime("%Y%m%d-%H%M%S"), []
    later = [path for path in list_checkpoints(run_dir) if checkpoint_step(path) > step]
    later_best = [e for e in read_index(run_dir) if e["step"] > step]
    if later or later_best:
        folder = _aside(run_dir / run_files.CHECKPOINTS / "timeline", stamp)
        folder.mkdir()
        for path in later:
            checkpoint_files.move(path, folder)
        best = set_aside_after(run_dir, step, folder)
        among_best = f" ({best} of them among the best)" if best else ""
        said.append(f"{len(later) + best} later checkpoint(s) of the abandoned timeline{among_best} set aside in "
                    f"{folder.relative_to(run_dir)}")
    for name in run_files.ROWS:
        said += split_rows(run_dir / name, lambda row_step: row_step <= step, f"rows after step {step}", stamp)
    said += _rows_lost_before(run_dir / run_files.METRICS, step)
    for name in (run_files.SUMMARY, run_files.DIAGNOSIS):
        if (run_dir / name).is_file():
            said.append(f"{name} set aside in {(run_dir / name).rename(_aside(run_dir / name, stamp)).name}")
    return said


def split_rows(path: Path, keep: Callable[[int], bool], what: str, stamp: str) -> list[str]:
    """Keep the rows of path whose step passes keep(); the others, and lines that are not rows (one cut by a
    kill, one garbled on disk), go to a set-aside file beside it. Every valid row is kept or set aside, never
    dropped. Returns one line saying what was set aside where (none when nothing was)."""
    if not path.is_file():
        return []
    kept, aside, unreadable = [], [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        row_step = _row_step(line)
        unreadable += row_step is None
        (kept if row_step is not None and keep(row_step) else aside).append(line)
    if not aside:
        return []
    target = _aside(path, stamp)
    io.atomic_write_text(target, "".join(line + "\n" for line in aside))
    io.atomic_write_text(path, "".join(line + "\n" for line in kept))
    parts = ([f"{len(aside) - unreadable} {what}"] if len(aside) > unreadable else []) + \
        ([f"{unreadable} unreadable line(s)"] if unreadable else [])
    return [f"{path.name}: {' and '.join(parts)} set aside in {target.name}"]


def _rows_lost_before(path: Path, step: int) -> list[str]:
    """The steps up to the checkpoint whose rows metrics.jsonl lacks (a file cut or edited on disk): the run
    continues exactly from its checkpoint, but those rows cannot be made again, and a report would hide it."""
    from ampctl.reports.runs import row_problems

    rows = [{"step": s} for line in (path.read_text(encoding="utf-8", errors="replace").splitlines()
                                     if path.is_file() else []) if (s := _row_step(line)) is not None]
    problems = row_problems(rows, through=step)
    return [f"metrics.jsonl up to the checkpoint at step {step}: {'; '.join(problems)} (lost on disk "
            "before this resume; the run continues exactly from its checkpoint)"] if problems else []


def set_aside_unreadable_rows(run_dir: Path) -> list[str]:
    """At the end of a run: a line of metrics.jsonl that is not a row (garbled on disk) is set aside, so that
    every reader sees whole rows; the valid rows around it all stay."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return split_rows(run_dir / run_files.METRICS, lambda _step: True, "", stamp)


def _row_step(line: str) -> Optional[int]:
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def remove_if_only_hydra_files(run_dir: Path) -> None:
    """A run refused before it recorded a step leaves no directory behind (Hydra creates it before the job)."""
    logs = job_logs(run_dir)
    if run_dir.is_dir() and all(is_leftover(p, logs) or created_here(p) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)
        # and the dated folders Hydra made for it (outputs/<date>/), when nothing else is in them
        here = Path.cwd().resolve()
        for parent in run_dir.resolve().parents:
            if parent == here or here not in parent.parents or any(parent.iterdir()):
                break
            parent.rmdir()
