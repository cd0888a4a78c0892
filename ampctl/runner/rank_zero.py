"""A part of a distributed step that rank 0 alone takes (finishing a checkpoint: its checks, checksums and rename),
and how it ended, told to every rank.

Without this, a rank 0 that refused a checkpoint (a shard missing on node-local disks) or could not write it (a full
disk) left the command while the other ranks went on into the next step, whose first collective failed with gloo's
or NCCL's "connection closed by peer" and a hundred lines of traceback on every other node, none of them saying why.
Every rank now leaves the same way rank 0 does, with one line naming rank 0's reason, and the same exit code.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Callable, Optional

from ampctl.errors import RunStopped, UsageError, write_refused

if TYPE_CHECKING:
    from ampctl.engine.parallel import Parallel


def told_to_every_rank(parallel: Parallel, what: str, work: Callable[[], None]) -> None:
    """work() on rank 0; then (a collective: every rank calls it at the same point) every other rank raises what rank
    0 raised, as the same kind of ending: a refusal, a refused write, a failure (whose traceback rank 0 prints).
    what: what rank 0 was doing, for the other ranks' line ("finishing checkpoint step_00000002.dcp")."""
    failure: Optional[Exception] = None
    if parallel.is_main:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - told to the others below, then raised here as it was
            failure = exc
    if parallel.world_size > 1:
        told = parallel.main_value(None if failure is None else _described(failure))
        if not parallel.is_main and told is not None:
            raise _as_raised_here(told, what)
    if failure is not None:
        raise failure


def _described(exc: Exception) -> tuple[str, str, Optional[int], Optional[str]]:
    """(kind, message, errno, filename): what the other ranks need to end the same way, picklable."""
    if isinstance(exc, UsageError):
        return "refused", str(exc), None, None
    if write_refused(exc):
        assert isinstance(exc, OSError)
        return "write refused", exc.strerror or str(exc), exc.errno, exc.filename
    return "failed", f"{type(exc).__name__}: {exc}", None, None


def _as_raised_here(told: tuple[str, str, Optional[int], Optional[str]], what: str) -> Exception:
    kind, message, number, filename = told
    if kind == "refused":
        return UsageError(f"rank 0 refused: {message}")  # its message names what it refused
    if kind == "write refused":
        return OSError(number or errno.EIO, message, filename)  # rank 0's file: the one the machine refused
    return RunStopped(f"rank 0 failed {what} ({message}); its traceback is in rank 0's output")
