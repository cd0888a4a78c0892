"""This process among others: the ones a command starts die with it, and torchrun's ranks read who they are.

The processes a command starts (a comparison's modes, the memory study's probes) die with it.

A parent killed with `kill -9` cannot stop its children, and a child started in a session of its own (so that
one Ctrl-C at the terminal reaches it once, forwarded) would train on as an orphan. So each child asks the
kernel for a signal when its parent dies (Linux's PR_SET_PDEATHSIG): SIGTERM, which a training run answers by
finishing its step and writing a checkpoint. The parent's pid travels in the environment; the child checks it
is still its parent after asking, in case the parent died first.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

PARENT_ENV = "AMPCTL_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_environment() -> dict[str, str]:
    """os.environ for a child that must die with this process."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with child_environment(): SIGTERM when the parent dies (now, if it already has)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not parent.isdigit():
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(parent):  # it died before the kernel was asked: nothing would tell us
        os.kill(os.getpid(), signal.SIGTERM)


def is_main_process() -> bool:
    """Rank 0, or no torchrun: before any process group exists (the command line, Hydra's run dir). From the
    environment torchrun sets, so that the command line asks without importing torch."""
    return int(os.environ.get("RANK", "0")) == 0


# Ranks other than 0 write nothing of their own: no Hydra run dir, .hydra files or log (they record into
# rank 0's run dir, which they learn from rank 0 once the process group is up).
NON_MAIN_HYDRA_OVERRIDES = ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                            "hydra/hydra_logging=disabled", "hydra.run.dir=."]


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def exit_worker() -> NoReturn:
    """End a torchrun worker whose run succeeded: flush what it wrote, then leave without interpreter
    shutdown. The process group is destroyed by then, but C++ objects of the backend that are still
    referenced (gloo's worker threads) would be destroyed during shutdown, where they can abort the process
    ("terminate called without an active exception") and fail a finished job."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
