"""What ends a command other than its success, as exceptions, and the tests of an OSError that is the machine's
refusal of a write. How each ends the command (its line, exit code, clean-up): shell/outcomes.py."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional

USAGE_EXIT_CODE = 2
WRITE_FAILED_EXIT_CODE = 74  # sysexits.h's EX_IOERR: a run's record could not be written (disk full, read-only)

# errnos of a write the machine refused (not a bug): no space, over quota, read-only, not permitted, too large
WRITE_REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                                  errno.EFBIG, errno.EIO})


def print_error(line: str, this_rank_alone: bool = False) -> None:
    """One line on stderr; under torchrun from each node's first process only (LOCAL_RANK 0): every rank meets the
    same end, and each node's output is read apart (a job over two hosts: each host's log says why it stopped).
    this_rank_alone: an end this rank met alone (its recipe raised), which it says itself."""
    if this_rank_alone or int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)


def cannot_write(exc: OSError) -> str:
    """The one phrase for a write the machine refused: `cannot write PATH: REASON` (each command adds what it
    means for its files)."""
    return f"cannot write {exc.filename}: {exc.strerror}"


def write_refused(exc: BaseException) -> bool:
    """An OSError of a write the machine refused, naming the file (one line for the user, not a traceback)."""
    return isinstance(exc, OSError) and exc.errno in WRITE_REFUSED_ERRNOS and exc.filename is not None


# how Rust's std::io::Error shows an OS error (safetensors' SafetensorError: "I/O error: No space left on device (os
# error 28)"): the errno travels only in the text
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def refused_write_inside(exc: BaseException) -> Optional[OSError]:
    """The refused write (a full disk, a read-only target) that a library's error carries: torch's zip writer keeps
    the OSError as the RuntimeError's context, DCP's CheckpointException in its failures (rank -> (error, traceback)),
    safetensors' Rust writer in its message. None when there is none."""
    failures = getattr(exc, "failures", None)
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
    for cause in [exc, *causes]:
        seen: Optional[BaseException] = cause
        while seen is not None:
            if isinstance(seen, OSError) and seen.errno in WRITE_REFUSED_ERRNOS:
                return seen
            rust = _RUST_OS_ERROR.search(str(seen))
            if rust and int(rust.group(1)) in WRITE_REFUSED_ERRNOS:
                return OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
            seen = seen.__cause__ or seen.__context__
    return None


FULL_BELOW_BYTES = 1 << 20  # a file system with less room than this after a failed write is taken for full


def full_disk_at(path: Any) -> Optional[OSError]:
    """ENOSPC for path where its file system is full, or as good as (a write that failed there did so for want of
    room, whatever the library made of the OSError: DCP's writers in another process say "unexpected pos 704 vs
    598", their OSError lost crossing back); None otherwise."""
    folder = os.path.abspath(str(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    if stats.f_bavail * stats.f_frsize >= FULL_BELOW_BYTES:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@contextlib.contextmanager
def naming_refused_writes(path: Any) -> Iterator[None]:
    """A library's error that carries a refused write (refused_write_inside) raised as that OSError, naming path; a
    failure while path's file system is full, as its ENOSPC."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        refused = refused_write_inside(exc) or full_disk_at(path)
        if refused is None:
            raise
        raise OSError(refused.errno, refused.strerror, str(path)) from None


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, no traceback, exit code 2."""


class ConfigError(UsageError):
    """A config value out of its allowed range, naming the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not allowed: expected {allowed}")


class UnsupportedError(UsageError):
    """A combination this device or torch build cannot honour. Refused, never silently downgraded.

    if_bf16_is_fast: words that add precision=bf16 to the alternatives the refusal names, where bf16 runs at speed
    on this device. The engine that refuses does not measure the machine; the check above it does and adds them."""

    def __init__(self, message: str, if_bf16_is_fast: str = "") -> None:
        super().__init__(message)
        self.if_bf16_is_fast = if_bf16_is_fast

    def adding(self, words: str) -> "UnsupportedError":
        """This refusal (its kind and its fields kept), its line ending with more words."""
        self.args = (f"{self}{words}",)
        return self


class ModeUnsupported(UnsupportedError):
    """A precision mode that cannot run on this device or torch build, whatever else the config holds (its optimizer,
    its recipe): `reason` says why in a few words, for a table's row (compare's skipped modes)."""

    def __init__(self, mode: str, reason: str, then: str, if_bf16_is_fast: str = "") -> None:
        """then: what the line says after the reason (where it runs, what to use instead), with its punctuation."""
        super().__init__(f"precision={mode} {reason}{then}", if_bf16_is_fast)
        self.mode, self.reason = mode, reason


class RunStopped(Exception):
    """A guard stopped the run (non-finite values, the scale at its minimum): not the user's typing, exit 1."""

    this_rank_alone = False  # an end one rank met alone (its recipe raised, its saving process died): it says it


class RankStopped(RunStopped):
    """A run one rank stopped for a reason of its own (its checkpoint saving process died): that rank says why;
    the others end as torchrun ends them."""

    this_rank_alone = True


class RecipeFailed(RankStopped):
    """The user's recipe raised while the run trained (recipes/failures.py): the line, then the user's own frames;
    the whole traceback for the run's log."""

    def __init__(self, line: str, frames: list[str], full_traceback: str) -> None:
        super().__init__(line)
        self.frames, self.full_traceback = frames, full_traceback


class CommandLineRefused(BaseException):
    """A UsageError found by a Hydra callback (the check of every job of a sweep), carried out of Hydra to the
    router. A BaseException because Hydra turns an Exception raised by a callback into a warning and goes on."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(str(error))


class NothingToDo(BaseException):
    """A command whose work is done already (a finished run resumed with its own number of steps): said in one line,
    exit 0, nothing written. A BaseException, as CommandLineRefused, to leave Hydra's callback that finds it before
    Hydra writes anything."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class SomeRunsFailed(BaseException):
    """A command that ran to its end, some of whose runs failed (a sweep's jobs, a comparison's modes, the runs a
    report reads): each is named in its table, the exit code says that some did. A BaseException for the reason
    CommandLineRefused is one: the sweep's table is written by a Hydra callback."""

    def __init__(self, failed: int) -> None:
        self.failed = failed
        super().__init__(f"{failed} failed")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for the commands that are not Hydra apps (list, init): a bad argument is a UsageError, said in one
    line (`ampctl list: error: ...`, exit 2) as in every command, instead of argparse's usage block and exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
