"""How every command ends, as one table (shell/outcomes.py): each outcome's exit code, its clean-up, and
whether a sweep goes on past it; and leave() doing what the table says."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ampctl.errors import CommandLineRefused, RunStopped, SomeRunsFailed, UsageError
from ampctl.interrupt import Interrupted, Signalled
from ampctl.shell.outcomes import ENDINGS, Outcome, exit_code_of, outcome_of
from ampctl.studies.compare import CompareInterrupted

REPO = Path(__file__).resolve().parents[2]


def raised_while_handling(interrupt: BaseException, error: Exception) -> Exception:
    """error as a library's clean-up raises it after a stop signal broke it off (its __context__ the interrupt)."""
    try:
        try:
            raise interrupt
        except BaseException:
            raise error
    except Exception as exc:
        return exc


# (what ended the command, its outcome, exit code, a directory with only Hydra's files removed, a sweep goes on)
TABLE = [
    (UsageError("train.steps=-1 is not allowed"), Outcome.REFUSED, 2, True, True),
    (CommandLineRefused(UsageError("a job of the sweep")), Outcome.REFUSED, 2, True, True),
    (OSError(errno.ENOSPC, "No space left on device", "run/metrics.jsonl"), Outcome.WRITE_REFUSED, 74, True, True),
    (OSError(errno.EROFS, "Read-only file system", "run/train.log"), Outcome.WRITE_REFUSED, 74, True, True),
    (Interrupted(signal.SIGINT, 12, "run/checkpoints/step_00000012.pt"), Outcome.STOPPED_ON_SIGNAL, 130, True, False),
    (Interrupted(signal.SIGTERM, 3, None), Outcome.STOPPED_ON_SIGNAL, 143, True, False),
    (Interrupted(signal.SIGUSR1, 3, None), Outcome.STOPPED_ON_SIGNAL, 138, True, False),
    (KeyboardInterrupt(), Outcome.INTERRUPTED, 130, True, False),
    (Signalled(signal.SIGHUP), Outcome.INTERRUPTED, 129, True, False),
    # Ctrl-C while Hydra composed: OmegaConf's clean-up of a half-built node failed (CI, 2026-11-26)
    (raised_while_handling(KeyboardInterrupt(), AttributeError("'NoneType' object has no attribute "
                                                               "'_invalidate_flags_cache'")),
     Outcome.INTERRUPTED, 130, True, False),
    (raised_while_handling(Signalled(signal.SIGTERM), UsageError("a half-read value")), Outcome.INTERRUPTED, 143, True,
     False),
    (RunStopped("every step was skipped"), Outcome.TRAINING_FAILED, 1, False, True),
    (CompareInterrupted(signal.SIGTERM, ["fp32"]), Outcome.STOPPED_ON_SIGNAL, 143, True, False),
    (SomeRunsFailed(2), Outcome.SOME_RUNS_FAILED, 1, False, True),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), Outcome.READER_GONE, 0, False, True),
    (OSError(errno.ENOENT, "No such file or directory", "data/x.png"), Outcome.BUG, 1, False, True),
    (RuntimeError("a bug"), Outcome.BUG, 1, False, True),
]


@pytest.fixture
def stdout_reader_gone(monkeypatch):
    """stdout a pipe whose reader has closed it (`ampctl list | head -1` after head's line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "__stdout__", stdout)
    yield
    stdout.close()


@pytest.mark.parametrize("exc, outcome, code, removes, sweep_goes_on", TABLE, ids=lambda v: type(v).__name__)
def test_every_outcome_has_its_exit_code_clean_up_and_sweep_rule(exc, outcome, code, removes, sweep_goes_on, request):
    if isinstance(exc, BrokenPipeError):  # stdout's reader gone: the one broken pipe that is no failure
        request.getfixturevalue("stdout_reader_gone")
    assert outcome_of(exc) is outcome
    assert exit_code_of(exc) == code
    assert ENDINGS[outcome].removes_an_empty_run_dir is removes
    assert ENDINGS[outcome].sweep_goes_on is sweep_goes_on


def test_a_broken_pipe_that_is_not_stdouts_is_a_failure_not_a_reader_gone():
    """A child process's pipe (a checkpoint saving process killed): it ended the run with exit 0 and nothing said."""
    assert outcome_of(BrokenPipeError(errno.EPIPE, "Broken pipe")) is Outcome.BUG


def test_the_table_covers_every_outcome():
    assert set(ENDINGS) == set(Outcome) == {row[1] for row in TABLE}


@pytest.mark.parametrize("holds_a_record", [False, True])
def test_leave_removes_a_directory_that_holds_only_hydras_files_says_its_lines_and_exits(tmp_path, holds_a_record):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("a: 1\n")
    if holds_a_record:
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    script = ("import sys; from pathlib import Path; from ampctl.shell.outcomes import leave; "
              "from ampctl.errors import UsageError; "
              f"run_dir = Path({str(run_dir)!r}); "
              "leave(UsageError('x'), lambda: ['still there: %s' % run_dir.is_dir()], run_dir)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"still there: {holds_a_record}\n"  # the lines are made after the clean-up
    assert run_dir.is_dir() is holds_a_record


def test_leave_after_a_signal_exits_with_128_plus_its_number(tmp_path):
    script = ("import signal; from ampctl.shell.outcomes import leave; from ampctl.interrupt import Signalled; "
              "leave(Signalled(signal.SIGTERM), ['ampctl: interrupted (SIGTERM)'])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (done.returncode, done.stderr) == (143, "ampctl: interrupted (SIGTERM)\n")


# The exits that are not a command's end: the second stop signal's exit at once, a command leaving after its stop
# signal without the interpreter's teardown, a torchrun worker's and and a forked child's end
OTHER_EXITS_ALLOWED = {("ampctl/interrupt.py", "os._exit"), ("ampctl/processes.py", "os._exit"),
                       ("ampctl/preloaded.py", "os._exit"),}


def test_leave_is_the_one_way_out_of_every_command():
    """No module ends the process or writes an exit code of its own: every command, the sweep's callback and the
    router leave through the outcome table (commands/outcomes.leave), and 128 + signum is computed in one place."""
    import ast

    found = []
    for path in sorted((REPO / "ampctl").rglob("*.py")):
        module = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("sys.exit", "os._exit", "exit", "quit", "SystemExit") and \
                        (module, name) not in OTHER_EXITS_ALLOWED and module != "ampctl/shell/outcomes.py":
                    found.append(f"{module}:{node.lineno} {name}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and \
                    any(isinstance(side, ast.Constant) and side.value == 128 for side in (node.left, node.right)):
                if module != "ampctl/interrupt.py":
                    found.append(f"{module}:{node.lineno} 128 + ...")
        if module not in ("ampctl/errors.py", "ampctl/shell/outcomes.py"):
            text = path.read_text()
            if "USAGE_EXIT_CODE" in text or "WRITE_FAILED_EXIT_CODE" in text:
                found.append(f"{module}: an exit code of its own")
    assert found == []


def test_a_refused_write_is_said_in_one_phrase():
    import re

    phrases = [(path, line) for path in sorted((REPO / "ampctl").rglob("*.py"))
               for line in path.read_text().splitlines() if re.search(r"cannot write \{", line)]
    assert [str(path.relative_to(REPO)) for path, _ in phrases] == ["ampctl/errors.py"], phrases


def test_a_signal_ignored_when_ampctl_starts_stays_ignored_outside_the_loop():
    """nohup ignores SIGHUP, a shell ignores SIGINT for its background jobs: ampctl's handlers do not undo that."""
    script = ("import signal; from ampctl.interrupt import raise_on_signals; raise_on_signals(); "
              "print(*(signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)))")

    def ignore_int_and_hup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60,
                          preexec_fn=ignore_int_and_hup)
    assert done.stdout.split() == ["True", "True", "False"], done.stderr


def test_an_error_a_stop_signal_caused_leaves_the_command_line_as_that_signal():
    """The router meets the error (not the interrupt) when a library's clean-up fails after Ctrl-C: it still says
    the one line of an interrupted command and exits 128 + the signal, with no traceback."""
    script = ("import signal; from ampctl import cli; from ampctl.interrupt import Signalled\n"
              "def composing(_args):\n"
              "    try:\n"
              "        raise Signalled(signal.SIGHUP)\n"
              "    except BaseException:\n"
              "        raise AttributeError('half-built node')\n"
              "cli.dispatch = composing\n"
              "cli.main(['train'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (129, "ampctl: interrupted (SIGHUP) before anything was "
                                                           "recorded"), done.stderr


def test_a_signal_the_moment_its_handler_is_set_is_one_line():
    """A Ctrl-C that lands as the router starts, just after its handlers are set (the first statement that can
    see it), says the interrupted line and exits 128 + the signal: it came out as a traceback (found in CI)."""
    script = ("import os, signal; from ampctl import cli\n"
              "cli.quiet_library_deprecations = lambda: os.kill(os.getpid(), signal.SIGINT)\n"
              "cli.main(['list'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (130, "ampctl: interrupted (SIGINT) before anything was "
                                                           "recorded"), done.stderr


def test_an_error_without_a_signal_behind_it_is_not_taken_for_one():
    from ampctl.interrupt import interrupt_behind, interrupts_surfaced

    error = raised_while_handling(ValueError("first"), RuntimeError("second"))
    assert interrupt_behind(error) is None
    with pytest.raises(RuntimeError), interrupts_surfaced():
        raise error
    with pytest.raises(Signalled) as surfaced, interrupts_surfaced():
        raise raised_while_handling(Signalled(signal.SIGTERM), OSError("cleanup"))
    assert surfaced.value.signum == signal.SIGTERM


def test_a_preemption_signal_the_host_handles_stops_the_loop_and_is_handed_back_to_the_host():
    """An engine that runs ampctl and set a handler for its warning first (submitit's SIGUSR2 requeues its job) is
    neither switched off (ampctl ignored the preemption signal it did not choose) nor left to end the run before
    its checkpoint: the loop stops on it, and after the stop the host's handler runs and picks the exit code
    (submitit's local executor requeues on 144). ampctl's own handlers are no host; a host that refuses is said."""
    script = """
import os, signal, sys
from ampctl.shell.outcomes import leave
from ampctl.interrupt import Interrupted, StopOnSignal, hand_over, host_of, raise_on_signals

def requeue(signum, frame):
    print("host requeues", flush=True)
    sys.exit(144)

raise_on_signals()  # ampctl's own handler on SIGUSR1: not a host's
signal.signal(signal.SIGUSR2, requeue)
with StopOnSignal("", preempt_signal=None) as stop:
    os.kill(os.getpid(), signal.SIGUSR1)  # ignored in the loop: neither chosen nor a host's
    os.kill(os.getpid(), signal.SIGUSR2)
print(stop.signum == signal.SIGUSR2, host_of(signal.SIGUSR1), host_of(signal.SIGUSR2), flush=True)
def refuse(signum, frame):
    raise RuntimeError("timed-out too many times")
signal.signal(signal.SIGUSR1, refuse)
with StopOnSignal("", preempt_signal="SIGUSR1"):
    pass
print(hand_over(signal.SIGUSR1), flush=True)
code, refused = hand_over(signal.SIGUSR2)
leave(Interrupted(signal.SIGUSR2, 7, None), [f"refused: {refused}"], host_exit_code=code)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.stdout.splitlines() == ["True None __main__", "(None, 'RuntimeError: timed-out too many times')",
                                        "host requeues"], done.stderr
    assert (done.returncode, done.stderr) == (144, "refused: None\n")


def test_a_sweeps_stop_request_stops_the_loop_as_the_signal_it_names(tmp_path):
    """conf/sweeps.STOP_REQUEST, written by a sweep's launcher for jobs its Ctrl-C does not reach: looked for at
    most once a second (a stat per step would be a metadata request per step on a cluster's file system)."""
    from ampctl.conf.sweeps import STOP_REQUEST, clear_stop_request, request_stop
    from ampctl.interrupt import StopOnSignal

    request = tmp_path / STOP_REQUEST
    stop = StopOnSignal("", request_file=request)
    assert not stop.requested
    request_stop(tmp_path, "SIGTERM")
    assert not stop.requested  # looked for less than a second ago
    stop._next_look = 0.0
    assert stop.requested and stop.signum == signal.SIGTERM
    clear_stop_request(tmp_path)
    assert not request.exists()
