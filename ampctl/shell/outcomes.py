"""How a command ends: every outcome with its exit code and its clean-up, in one table that every command reads, and
leave(), the one way out of a command other than success (tests/unit/test_outcomes.py finds any other). The Python
API raises instead, and cleans up the same way.

What each front end says is its own (a run names its checkpoint and continue command, a study where its
measurements are); what it exits with, what it removes and whether a sweep goes on past it are decided here."""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, Sequence, Union

from ampctl.errors import (
    USAGE_EXIT_CODE,
    WRITE_FAILED_EXIT_CODE,
    CommandLineRefused,
    RunStopped,
    SomeRunsFailed,
    UsageError,
    cannot_write,
    print_error,
    write_refused,
)
from ampctl.interrupt import StoppedOnSignal, exit_at_once_on_another_signal, interrupt_behind, signal_exit_code
from ampctl.io import for_the_terminal
from ampctl.shell.this_process import THIS_PROCESS


class Outcome(enum.Enum):
    """Every way a command ends other than success, each told apart by what the user does next."""

    REFUSED = "refused"  # the user's mistake (a value, a combination, a directory that is not the run's own): fix it
    WRITE_REFUSED = "write refused"  # the machine refused a write (a full disk, a read-only directory): free it
    # a stop signal the command handled where it was (the training loop after its step, with a checkpoint; a
    # comparison's runs): what it did is kept, and it continues from there
    STOPPED_ON_SIGNAL = "stopped on a signal"
    # a stop signal where nothing handles one (importing, composing, building, the summary): nothing new is kept
    INTERRUPTED = "interrupted"
    TRAINING_FAILED = "training failed"  # the run ended itself (a guard, every loss non-finite, the recipe raised)
    SOME_RUNS_FAILED = "some runs failed"  # the command ran to its end; its table names the runs that failed
    READER_GONE = "reader gone"  # stdout's reader closed it (`ampctl list | head -1`): it had what it wanted
    BUG = "bug"  # anything else: its traceback


@dataclass(frozen=True)
class Ending:
    exit_code: Optional[int]  # None: the signal's (interrupt.signal_exit_code: 130 for SIGINT)
    removes_an_empty_run_dir: bool  # a directory that holds only Hydra's files is removed: nothing was recorded
    sweep_goes_on: bool  # in a sweep, the job's failure is recorded in its directory and the next job runs


ENDINGS: dict[Outcome, Ending] = {
    Outcome.REFUSED: Ending(USAGE_EXIT_CODE, removes_an_empty_run_dir=True, sweep_goes_on=True),
    Outcome.WRITE_REFUSED: Ending(WRITE_FAILED_EXIT_CODE, removes_an_empty_run_dir=True, sweep_goes_on=True),
    Outcome.STOPPED_ON_SIGNAL: Ending(None, removes_an_empty_run_dir=True, sweep_goes_on=False),
    Outcome.INTERRUPTED: Ending(None, removes_an_empty_run_dir=True, sweep_goes_on=False),
    Outcome.TRAINING_FAILED: Ending(1, removes_an_empty_run_dir=False, sweep_goes_on=True),
    Outcome.SOME_RUNS_FAILED: Ending(1, removes_an_empty_run_dir=False, sweep_goes_on=True),
    Outcome.READER_GONE: Ending(0, removes_an_empty_run_dir=False, sweep_goes_on=True),
    Outcome.BUG: Ending(1, removes_an_empty_run_dir=False, sweep_goes_on=True),
}


def outcome_of(exc: BaseException) -> Outcome:
    if isinstance(exc, (UsageError, CommandLineRefused)) and interrupt_behind(exc) is None:
        return Outcome.REFUSED
    if isinstance(exc, StoppedOnSignal):
        return Outcome.STOPPED_ON_SIGNAL
    # Ctrl-C, interrupt.Signalled for the other stop signals, and an error such a signal caused
    if interrupt_behind(exc) is not None:
        return Outcome.INTERRUPTED
    if isinstance(exc, RunStopped):
        return Outcome.TRAINING_FAILED
    if isinstance(exc, SomeRunsFailed):
        return Outcome.SOME_RUNS_FAILED
    if isinstance(exc, BrokenPipeError) and stdout_reader_gone():
        return Outcome.READER_GONE
    if write_refused(exc):
        return Outcome.WRITE_REFUSED
    return Outcome.BUG


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (`ampctl list | head -1`): a broken pipe of another (a child
    process's, a socket's) is no reader's choice, and was once taken for one (a dead checkpoint-saving process, exit
    0 and nothing said). Stdout already sent to /dev/null after the reader left counts as gone."""
    import select

    try:
        fd = sys.__stdout__.fileno()
        if os.path.samestat(os.fstat(fd), os.stat(os.devnull)):
            return True
        poller = select.poll()
        poller.register(fd, select.POLLERR)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def ending_of(exc: BaseException) -> Ending:
    return ENDINGS[outcome_of(exc)]


def exit_code_of(exc: BaseException) -> int:
    code = ending_of(exc).exit_code
    return code if code is not None else signal_exit_code(getattr(interrupt_behind(exc) or exc, "signum",
                                                                   signal.SIGINT))


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
        THIS_PROCESS.put_back_earlier_hydra_files()  # an earlier run's, Hydra wrote this command's over them
    for line in lines() if callable(lines) else lines:
        # on a terminal, broken at words (the terminal broke a long line mid-word at 80 columns)
        print_error(for_the_terminal(line, sys.stderr), this_rank_alone=getattr(exc, "this_rank_alone", False))
        if log is not None:
            log(line.strip())
    sys.exit(code)


def refuse(command: str, message: str) -> NoReturn:
    """The command line refused: `ampctl <command>: error: <message>`, as the table says for a refusal."""
    leave(UsageError(message), [f"ampctl {command}: error: {message}"])


def write_refused_line(command: str, exc: OSError, what_it_means: str) -> str:
    """`ampctl <command>: error: cannot write PATH: REASON<what_it_means>`: a refused write, said by every command
    alike; what_it_means says what the command kept (`; no checkpoint was written`, ` (nothing was written)`)."""
    return f"ampctl {command}: error: {cannot_write(exc)}{what_it_means}"


@contextlib.contextmanager
def said_in_one_line(command: str, write_refused_means: str = " (nothing was written)") -> Iterator[None]:
    """A command that is not a Hydra app (export, report, list, init): its refusal and a write the machine refused,
    each one line with the table's exit code."""
    try:
        yield
    except UsageError as exc:
        refuse(command, str(exc))
    except OSError as exc:
        if not write_refused(exc):
            raise
        leave(exc, [write_refused_line(command, exc, write_refused_means)])
