"""This process among others: the ones a command starts die with it, torchrun's ranks read who they are, and
what a process imports is kept out of the garbage collector's scans.

The processes a command starts (a comparison's modes, the memory study's probes) die with it.

A parent killed with `kill -9` cannot stop its children, and a child started in a session of its own (so that
one Ctrl-C at the terminal reaches it once, forwarded) would train on as an orphan. So each child asks the
kernel for a signal when its parent dies (Linux's PR_SET_PDEATHSIG): SIGTERM, which a training run answers by
finishing its step and writing a checkpoint. The parent's pid travels in the environment; the child checks it
is still its parent after asking, in case the parent died first.

What a process imports stays out of the cyclic garbage collector's work. Importing torch (and the Dynamo its
optimizers import) makes ~340,000 objects that live as long as the process; CPython runs a full collection each
time the objects it tracks grow by a quarter, so it scans them again and again while they are imported, at each
measurement's gc.collect() and at exit: 3-7 full collections of 0.1-0.2 s each, 0.3-0.8 s of a 4-5 s `ampctl train`
on 2 cores (counted with gc.callbacks). gc.freeze() moves them where the collector does not look, as CPython's
documentation advises for a process's long-lived start and for the children of a pre-fork server.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
from typing import Callable, Iterator, NoReturn

PARENT_ENV = "AMPCTL_PARENT_PID"
FORK_SERVER_PARENT_ENV = "AMPCTL_FORK_SERVER_PARENT_PID"  # the command a fork server serves (preloaded.py)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_environment() -> dict[str, str]:
    """os.environ for a child that must die with this process."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def die_with_parent(signum: int = signal.SIGTERM, env: str = PARENT_ENV) -> None:
    """In a child whose environment names its parent under `env` (child_environment()): `signum` when the parent
    dies (now, if it already has). The kernel watches the parent's thread that started the child: a command
    starts its children from its main thread."""
    parent = os.environ.pop(env, None)
    if parent is None or not parent.isdigit():
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != int(parent):  # it died before the kernel was asked: nothing would tell us
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def start_kept_out_of_collections() -> Iterator[Callable[[], None]]:
    """Around a command in a process that has not imported torch yet (a fresh `ampctl`): the collector is off
    while the command imports and plans its run. Yields the start's end, to call once the run is planned (its
    imports made, its config composed and checked: shell/checks.py): what is garbage of that is collected, once,
    and what lives on (modules, torch's registries, the config) is frozen. A process that imported torch before (the
    Python API's, a test's) is left as it is: its collector is its owner's, and what it holds may be garbage."""
    if "torch" in sys.modules or not gc.isenabled():
        yield lambda: None
        return
    uncollected = [True]  # until the start is over, or the command ends first

    def start_is_over() -> None:
        if not uncollected:
            return
        uncollected.clear()
        gc.collect()
        gc.freeze()
        gc.enable()

    gc.disable()
    try:
        yield start_is_over
    finally:
        if uncollected:  # it ended before a run was planned (a refusal, --cfg): collected as before
            uncollected.clear()
            gc.enable()


def freeze_what_the_fork_inherited() -> None:
    """In a child forked from a server that imported torch and ampctl (preloaded.py): all of that is the
    server's start, never garbage; its collections scan only what the child makes."""
    gc.freeze()


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
    """End a torchrun worker whose command succeeded (a run's, an export's): flush what it wrote, then leave
    without interpreter shutdown. The process group is destroyed by then, but C++ objects of the backend that are
    still referenced (gloo's worker threads, DCP's) would be destroyed during shutdown, where they can abort the
    process ("terminate called without an active exception": a two-rank export aborted so about once in seven) and
    fail a finished job. A failing worker leaves through shell/outcomes.leave as any process does: its interpreter
    shutdown gives the node's first rank the moment to say why before torchrun ends it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
