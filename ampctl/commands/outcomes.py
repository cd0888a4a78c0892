"""How a command ends: every outcome with its exit code and its clean-up, in one table that every front end reads
(cli.py, commands/train.py, commands/studies.py; the Python API raises instead, and cleans up the same way).

What each front end says is its own (a run names its checkpoint and continue command, a study where its
measurements are); what it exits with, what it removes and whether a sweep goes on past it are decided here."""

from __future__ import annotations

import enum
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence, Union

from ampctl.errors import (
    USAGE_EXIT_CODE,
    WRITE_FAILED_EXIT_CODE,
    CommandLineRefused,
    RecipeFailed,
    RunStopped,
    UsageError,
    print_error,
    write_refused,
)
from ampctl.interrupt import Interrupted, exit_at_once_on_another_signal, interrupt_behind


class Outcome(enum.Enum):
    REFUSED = "refused"  # the user's mistake (a value, a combination, a directory that is not the run's own)
    WRITE_REFUSED = "write refused"  # the machine refused a write (a full disk, a read-only directory)
    STOPPED_BY_SIGNAL = "stopped by a signal"  # the training loop stopped on a signal, with a checkpoint
    SIGNALLED = "signalled"  # a stop signal outside the loop (importing, composing, building, the summary)
    RUN_STOPPED = "run stopped"  # a guard, or a run whose every loss was non-finite
    BUG = "bug"  # anything else: its traceback


@dataclass(frozen=True)
class Ending:
    exit_code: Optional[int]  # None: 128 + the signal's number (the shell's convention: 130 for SIGINT)
    removes_an_empty_run_dir: bool  # a directory that holds only Hydra's files is removed: nothing was recorded
    sweep_goes_on: bool  # in a sweep, the job's failure is recorded in its directory and the next job runs


ENDINGS: dict[Outcome, Ending] = {
    Outcome.REFUSED: Ending(USAGE_EXIT_CODE, removes_an_empty_run_dir=True, sweep_goes_on=True),
    Outcome.WRITE_REFUSED: Ending(WRITE_FAILED_EXIT_CODE, removes_an_empty_run_dir=True, sweep_goes_on=True),
    Outcome.STOPPED_BY_SIGNAL: Ending(None, removes_an_empty_run_dir=True, sweep_goes_on=False),
    Outcome.SIGNALLED: Ending(None, removes_an_empty_run_dir=True, sweep_goes_on=False),
    Outcome.RUN_STOPPED: Ending(1, removes_an_empty_run_dir=False, sweep_goes_on=True),
    Outcome.BUG: Ending(1, removes_an_empty_run_dir=False, sweep_goes_on=True),
}


def outcome_of(exc: BaseException) -> Outcome:
    if isinstance(exc, (UsageError, CommandLineRefused)) and interrupt_behind(exc) is None:
        return Outcome.REFUSED
    if isinstance(exc, Interrupted):
        return Outcome.STOPPED_BY_SIGNAL
    # Ctrl-C, interrupt.Signalled for the other stop signals, and an error such a signal caused
    if interrupt_behind(exc) is not None:
        return Outcome.SIGNALLED
    if isinstance(exc, RunStopped):
        return Outcome.RUN_STOPPED
    if write_refused(exc):
        return Outcome.WRITE_REFUSED
    return Outcome.BUG


def ending_of(exc: BaseException) -> Ending:
    return ENDINGS[outcome_of(exc)]


def exit_code_of(exc: BaseException) -> int:
    code = ending_of(exc).exit_code
    return code if code is not None else 128 + getattr(interrupt_behind(exc) or exc, "signum", signal.SIGINT)


Lines = Union[Sequence[str], Callable[[], Sequence[str]]]


def leave(exc: BaseException, lines: Lines, run_dir: Optional[Path] = None,
          log: Optional[Callable[[str], None]] = None, host_exit_code: Optional[int] = None) -> NoReturn:
    """End the command as the table says for exc: after a signal, another one while leaving ends it at once; its
    clean-up (run_dir removed where it holds only Hydra's files: nothing was recorded); its lines on stderr
    (given as a function, made after the clean-up, which they may describe; from each node's first rank, as
    every rank meets the same end, or from the rank whose recipe raised; each also to `log`, the run's log file);
    its exit code, or the host's where the stop was handed to the engine that runs ampctl (interrupt.hand_over:
    submitit's requeue exits with its own)."""
    from ampctl.processes import is_main_process

    ending = ending_of(exc)
    code = exit_code_of(exc) if host_exit_code is None else host_exit_code
    if ending.exit_code is None:
        exit_at_once_on_another_signal(getattr(exc, "signum", signal.SIGINT), code)
    if ending.removes_an_empty_run_dir and run_dir is not None and is_main_process():
        from ampctl.runner.ownership import remove_if_only_hydra_files

        remove_if_only_hydra_files(run_dir)
    for line in lines() if callable(lines) else lines:
        print_error(line, this_rank_alone=isinstance(exc, RecipeFailed))
        if log is not None:
            log(line.strip())
    sys.exit(code)


def refuse(command: str, message: str) -> NoReturn:
    """The command line refused: `ampctl <command>: error: <message>`, as the table says for a refusal."""
    leave(UsageError(message), [f"ampctl {command}: error: {message}"])
