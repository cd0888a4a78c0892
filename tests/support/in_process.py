"""`ampctl ...` run inside the test's process, answered as a subprocess.run of it would be (exit code, stdout,
stderr), for the tests about what a command does rather than about the process it runs in.

A fresh interpreter costs ~4 s of CPU before ampctl does anything (torch, and the Dynamo that torch's optimizers
import on first use), and the suite is CPU-bound: the tests of signals, of the console script, of a process
killed or left running, of Python's own startup keep real processes (subprocess); the others run here. What a
run changes in this process (the working directory, environment variables, sys.argv and sys.path, the signal
handlers and the unraisable-exception hook ampctl installs) is put back afterwards; an exception that would end
the interpreter is printed as its traceback to the captured stderr with exit code 1, as Python would."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Optional

# the handlers ampctl's entry point installs (interrupt.raise_on_signals): this process's are restored after
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2))


def run_ampctl(*args: str, cwd: Optional[Path] = None, env: Optional[dict[str, str]] = None
               ) -> subprocess.CompletedProcess:
    from ampctl.cli import main

    saved_cwd, saved_env, saved_argv, saved_path = os.getcwd(), dict(os.environ), sys.argv[:], sys.path[:]
    saved_handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    saved_unraisable_hook = sys.unraisablehook  # ampctl's entry point wraps it (interrupt.raise_on_signals)
    saved_modules = set(sys.modules)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["ampctl", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what the interpreter would print, and its exit code
                traceback.print_exc()
                code = 1
    finally:
        _forget_a_signal_exit()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.unraisablehook = saved_unraisable_hook
        for signum, handler in saved_handlers.items():
            signal.signal(signum, handler)
        _forget_modules_of_experiment_dirs(set(sys.modules) - saved_modules)
    return subprocess.CompletedProcess(["ampctl", *args], code, out.getvalue(), err.getvalue())


def _forget_a_signal_exit() -> None:
    """A command that stopped on a signal registers an exit handler that ends the process at once with its code
    (interrupt.exit_at_once_on_another_signal): here the process is the test's, which goes on."""
    from ampctl.interrupt import SIGNALS

    SIGNALS.reset()


def _forget_modules_of_experiment_dirs(added: set[str]) -> None:
    """A module a run imported from an experiment directory (`-cd DIR`'s my_recipe.py) is that directory's: the
    next run, from another directory, imports its own module of that name, as its own process would."""
    ours = (str(Path(__file__).resolve().parents[2]), sys.prefix, sys.base_prefix)
    for name in added:
        where = getattr(sys.modules.get(name), "__file__", None) or ""
        if where and not where.startswith(ours):
            del sys.modules[name]
