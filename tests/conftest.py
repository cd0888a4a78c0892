from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# Under pytest-xdist (-n N) the cores are shared by N workers: each worker, and every ampctl, torchrun or python
# process its tests start, computes on cores/N threads. Left to itself each would take every core, and N x cores
# threads on cores cores spin against each other (the suite ran 35% slower on 2 cores with 2 workers). Set
# before torch starts its thread pools.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest
import torch

from ampctl.shell.hydra_internals import register_schemas

register_schemas()  # every command's: tests compose each command's config

@pytest.fixture
def restore_argv():
    saved = sys.argv[:]
    yield
    sys.argv = saved


def pytest_configure(config):
    if sys.flags.dont_write_bytecode and not hasattr(config, "workerinput"):  # once, before the workers start
        _compile_the_code_under_test()
    # pytest-xdist's default scheduler hands each worker a first chunk of a quarter of its share of the tests, in
    # collection order, and tops a worker up in chunks: with the slow tests first (below), one worker got all of
    # them in its first chunk while the other ran the short ones and then waited (~1,150 s against 979 s for the
    # same suite on 2 cores). One test at a time: each worker takes the next test when it is free, slow tests first.
    if getattr(config.option, "maxschedchunk", "absent") is None:  # pytest-xdist installed, the user chose no chunk
        config.option.maxschedchunk = 1


def _compile_the_code_under_test() -> None:
    """PYTHONDONTWRITEBYTECODE=1 (set in some images, as on this project's development machines) has every
    interpreter compile ampctl and the test support modules from their source: ~0.5 s of CPU in each of the hundreds
    of ampctl, torchrun rank and sweep job processes the suite starts. The flag stops only the interpreter's own
    writes, and each reads bytecode that is there: it is written once, where Python looks (__pycache__, which git
    ignores)."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("ampctl", "tests"):
        compileall.compile_dir(root / package, quiet=1)


def pytest_collection_modifyitems(config, items):
    # The slow tests first, each to whichever worker is free (pytest_configure), so the suite ends on short ones,
    # not on one worker's minute-long test while the other waits.
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: otherwise in the order collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What the terminal a test runs in says of itself: rich reads every one of these (TERM=dumb makes a forced
# terminal 80 columns wide whatever width it is given; COLUMNS sets the width; NO_COLOR and FORCE_COLOR the
# colours; TTY_* whether it is a terminal). Cleared for every test and the processes it starts, so that the suite
# says the same under any terminal, or none; a test that wants one sets its own (monkeypatch.setenv, after this).
TERMINAL_VARIABLES = ("TERM", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE",
                      "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")


@pytest.fixture(autouse=True)
def no_terminal_of_the_runners(monkeypatch):
    for name in TERMINAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def cpu_only_subprocesses(request, monkeypatch):
    """`ampctl` started by a test that is not marked gpu sees no GPU (this process's CUDA, if any, is
    initialised already and stays visible to the gpu-marked tests)."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _as_a_fresh_interpreter_has_it(signum: int) -> None:
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


# The tests send stop signals to the processes they start, as a terminal sends them to its foreground command. A
# suite started where they are ignored (bash ignores SIGINT for `cmd &` without job control, nohup SIGHUP) would
# hand that on to every such process, and ampctl keeps a signal ignored as it found it (a background job's
# contract): a sweep's launcher then never sees its Ctrl-C. The suite's processes start as from a terminal.
for _signum in _WATCHED_SIGNALS:
    if signal.getsignal(_signum) is signal.SIG_IGN:
        _as_a_fresh_interpreter_has_it(_signum)


def _inherited_signal_state() -> tuple[frozenset, frozenset]:
    """What a process this one starts inherits of its signals: those ignored, and the main thread's mask."""
    ignored = frozenset(signum for signum in _WATCHED_SIGNALS if signal.getsignal(signum) is signal.SIG_IGN)
    return ignored, frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))


@pytest.fixture(autouse=True)
def signals_left_as_found():
    """A test leaves this process's stop signals neither ignored nor blocked where it found them otherwise: every
    process a later test starts inherits both (a sweep's launcher that a Ctrl-C test then cannot stop)."""
    before = _inherited_signal_state()
    yield
    after = _inherited_signal_state()
    if after != before:
        for signum in after[0] - before[0]:
            _as_a_fresh_interpreter_has_it(signum)
        signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        pytest.fail(f"the test left stop signals ignored or blocked (ignored, blocked): {before} -> {after}",
                    pytrace=False)
