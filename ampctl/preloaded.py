"""The processes a study starts (a comparison's modes and seeds, the memory study's probes), forked from a server
that has imported torch and ampctl once.

A fresh interpreter spends ~6 s of CPU before an `ampctl train` does anything (torch, ampctl and Hydra, and the
Dynamo that torch's optimizers import on their first parameter group; measured on 2 cores), and a comparison
starts one per mode and seed, each counted against advise's budget. multiprocessing's forkserver (what torch's
DataLoader and torch.distributed.elastic offer for the same reason) imports them in a process that never
computes, and forks each child from it: ~1 s to a trained step. Every child is still a process of its own, with
nothing of another run's allocator caches, compiled kernels or peak memory. Only multiprocessing's public API is
used: the server is started with `set_forkserver_preload` and `ensure_running`, and children through a Process.

A child is started from the command line it would be exec'd with, `[sys.executable, "-m", MODULE, *args]` or
`[sys.executable, SCRIPT, *args]`, and has what that process would have: its argv, environment, working directory,
sys.path (its first entry, its PYTHONPATH), stdin, stdout and stderr (line-buffered), a session of its own, the
stop signals at their defaults, atexit handlers run at its end, an exit status as Popen's returncode (negative: the
signal that ended it) and, like every child a command starts (ampctl/processes.py), a SIGTERM when the command is
gone, even after `kill -9`: the kernel ends the server when the command dies (preloaded_server.py), and tells
each child when its parent, the server, goes.
What it does not have: what torch and ampctl read from the environment when they are imported is read once, in
the server, from the environment of the command that first started a child (the server serves this process
from then on).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import traceback
import types
from multiprocessing import forkserver, reduction, resource_tracker
from typing import Iterator, Mapping, Optional, Sequence

from ampctl.interrupt import PREEMPT_SIGNALS, STOP_SIGNALS
from ampctl.processes import FORK_SERVER_PARENT_ENV, PARENT_ENV, freeze_what_the_fork_inherited

# what every child imports before it does anything (`ampctl train`, a memory probe); torch._dynamo is imported by
# torch's optimizers on first use
PRELOAD = ["ampctl.preloaded_server", "torch", "torch._dynamo", "ampctl.cli", "ampctl.commands.train",
           "ampctl.runner.run", "ampctl.studies.memory_probe"]
_STOPS = tuple(dict.fromkeys((*STOP_SIGNALS, *PREEMPT_SIGNALS)))
_CONTEXT = multiprocessing.get_context("forkserver")


def _ensure_server() -> None:
    """Started by the first child a process starts, not earlier: its imports would compete for the cores with what
    the command measures before (the CPU probe, advise's calibration)."""
    # The server is in the command's process group: a stop signal sent to the group must reach the children once,
    # forwarded by the command, and must not end the server under them. It is started (fork, exec) with them
    # blocked, which it keeps; each child unblocks them. multiprocessing's resource tracker, which the server
    # needs, is started first: starting it unblocks SIGINT and SIGTERM in this process.
    resource_tracker.ensure_running()
    with _stop_signals_blocked(), _in_the_servers_environment(FORK_SERVER_PARENT_ENV, str(os.getpid())):
        _CONTEXT.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()


@contextlib.contextmanager
def _in_the_servers_environment(name: str, value: str) -> Iterator[None]:
    """The server starts with this process's environment: `name` is in it while it is started, and only then."""
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class PreloadedProcess:
    """A child forked from the server: what compare and memory use of subprocess.Popen (pid, poll, wait,
    send_signal, kill, returncode)."""

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str], stdin: Optional[int] = None,
                 stdout: Optional[int] = None, stderr: Optional[int] = None,
                 fds_in_env: Mapping[str, int] = {}, cwd: Optional[os.PathLike | str] = None) -> None:
        """command as it would be exec'd; stdin/stdout/stderr: descriptors of this process the child gets as its
        own 0/1/2 (None: /dev/null for stdin, this process's for the others); fds_in_env: a descriptor the child
        gets too, its number in the child in the named environment variable; cwd: its working directory (None:
        this process's)."""
        _ensure_server()
        target, args = _runnable(command)
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        self._process = _CONTEXT.Process(
            target=_child_main, name=" ".join(command[1:3]),
            args=(target, args, dict(env), workdir, _Inherited.of(stdin), _Inherited.of(stdout),
                  _Inherited.of(stderr), {name: _Inherited(fd) for name, fd in fds_in_env.items()}))
        with _no_main_module():
            self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._process.join(timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def _no_main_module() -> Iterator[None]:
    """multiprocessing runs the parent's __main__ script again in each child (as __mp_main__), so that functions
    defined there can be unpickled: a script calling `ampctl.compare(...)` without an `if __name__ == "__main__"`
    guard would compare again in every mode. A child here runs its own command and needs nothing of it: the start
    (which reads sys.modules["__main__"] while it pickles, in this thread) sees an empty one."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _runnable(command: Sequence[str]) -> tuple[tuple[str, str], list[str]]:
    """(("module"|"path", what), args) of `python -m MODULE ARGS` or `python SCRIPT ARGS`."""
    if len(command) >= 3 and command[1] == "-m":
        return ("module", command[2]), list(command[3:])
    if len(command) >= 2 and not command[1].startswith("-"):
        return ("path", command[1]), list(command[2:])
    raise ValueError(f"not a `python -m MODULE` or `python SCRIPT` command: {list(command)}")


class _Inherited:
    """A descriptor of this process that the child gets as one of its own (sent to the server as it forks)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def of(cls, fd: Optional[int]) -> Optional["_Inherited"]:
        return None if fd is None else cls(fd)

    def __reduce__(self):  # called while the child is being started: the descriptor travels with it
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate) -> int:
    return duplicate.detach()


def _child_main(target: tuple[str, str], args: list[str], env: dict[str, str], cwd: str, stdin: Optional[int],
                stdout: Optional[int], stderr: Optional[int], fds_in_env: dict[str, int]) -> None:
    """In the child: become the exec'd process the command names, run it, leave as its interpreter would."""
    freeze_what_the_fork_inherited()
    os.setsid()  # a session of its own: the terminal's Ctrl-C reaches it once, forwarded by the command
    # As an interpreter starts: until it runs the program every stop signal ends it by default (a stop the command
    # forwards while the child is being started ends it there, quietly, as such a signal ends a starting
    # interpreter); then Ctrl-C raises KeyboardInterrupt.
    for signum in _STOPS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    # The server received the descriptors as the lowest free numbers, which may be 0-2 (the server closed its
    # stdin; its other standard streams are whatever the command that started it had): lift them all above 2
    # before any becomes a standard stream, or one would be overwritten by another.
    stdin, stdout, stderr = (None if fd is None else _above_standard_streams(fd) for fd in (stdin, stdout, stderr))
    fds_in_env = {name: _above_standard_streams(fd) for name, fd in fds_in_env.items()}
    _as_standard_streams(stdin, stdout, stderr)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({name: str(fd) for name, fd in fds_in_env.items()})
    if PARENT_ENV in os.environ:  # its parent is the server, which leaves when the command does
        os.environ[PARENT_ENV] = str(os.getppid())
    os.chdir(cwd)
    _as_its_interpreter_would_find_modules(target, env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = _run(target, args)
    # The interpreter's own end, in its order (multiprocessing ends a child with os._exit, without it): threading's
    # exit hooks, which stop concurrent.futures' pools (Inductor keeps one for compiling), then the non-daemon
    # threads joined; then the atexit handlers (a command's own clean-up is among them). Joining the threads before
    # those hooks waited forever on a compiled run's pool.
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter and multiprocessing's own children call
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends Python by SIGINT (exit status 130 in a shell)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _as_its_interpreter_would_find_modules(target: tuple[str, str], env: Mapping[str, str]) -> None:
    """sys.path as its interpreter would start with it (the server's is that of the command that started it):
    first the working directory (`python -m`) or the script's own (`python SCRIPT`), then the child's PYTHONPATH
    (a test's recipe module, a user's: not found before), then the rest."""
    kind, what = target
    first = os.getcwd() if kind == "module" else os.path.dirname(os.path.abspath(what))
    own = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    rest = [entry for entry in sys.path[1:] if entry not in own]
    sys.path[:] = [first, *own, *rest]


def _above_standard_streams(fd: int) -> int:
    """The descriptor as one numbered 3 or more (a copy; the original closed), inheritable as it was."""
    if fd > 2:
        return fd
    lifted = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)
    os.close(fd)
    return lifted


def _as_standard_streams(stdin: Optional[int], stdout: Optional[int], stderr: Optional[int]) -> None:
    if stdin is None:  # multiprocessing closed the server's
        stdin = _above_standard_streams(os.open(os.devnull, os.O_RDONLY))
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if fd is not None:
            os.dup2(fd, target)
    for fd in {stdin, stdout, stderr} - {None}:
        os.close(fd)
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # type: ignore[misc]


def _run(target: tuple[str, str], args: list[str]) -> int:
    """The command's exit status as its interpreter would end with (-SIGINT: an uncaught KeyboardInterrupt)."""
    kind, what = target
    sys.argv = [what, *args]
    try:
        if kind == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it, with its exit status
        traceback.print_exc()
        return 1
    return 0
