"""Signals, in and outside the training loop.

In the loop: SIGINT, SIGTERM, SIGHUP and the batch system's preemption warning (train.cluster.preempt_signal) ask it to
stop after the current step (it then writes a checkpoint and flushes the metrics); a second exits at once.
Checkpoints are written atomically, so even that leaves every checkpoint on disk whole. The preemption
signals not chosen (SIGUSR1, SIGUSR2; all of them with train.cluster.preempt_signal=null) are ignored there, except one
that the process's host handles: an engine that started ampctl and set a handler for its warning before ampctl
did (submitit's SIGUSR2, which checkpoints and requeues its job) gets the signal back once the run's checkpoint is
written (hand_over), instead of either losing the checkpoint or being switched off.

Outside it (importing, composing, building, compiling): each of these signals ends the command as Ctrl-C
does, with one line and the exit code 128 + its number, and what Hydra made for a run that recorded nothing
removed (Signalled, raised by the handlers ampctl's entry point installs: ampctl/cli.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator, Optional


def signal_exit_code(signum: int) -> int:
    """The exit code of a command a signal ended: the shell's convention, 128 + its number (130 for SIGINT, 143 for
    SIGTERM). The one place it is computed."""
    return 128 + signum


class StoppedOnSignal(Exception):
    """A stop signal the command handled where it was: what it was doing stopped at a point it chose (the training
    loop after its step, with a checkpoint; a comparison's runs, each with its own), and what it did is kept."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        super().__init__(message)


class Interrupted(StoppedOnSignal):
    """The training loop stopped on a signal after step `step`, with its checkpoint (None: none could be written)."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]) -> None:
        self.step, self.checkpoint = step, checkpoint
        super().__init__(signum, f"{signal.Signals(signum).name} at step {step}")


# SIGINT (Ctrl-C), SIGTERM (kill, a scheduler), SIGHUP (the terminal closed): always a graceful stop
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# the batch systems' preemption warnings: train.cluster.preempt_signal chooses which stops the run gracefully
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class Signalled(KeyboardInterrupt):
    """A stop signal outside the training loop: handled where Ctrl-C is (a KeyboardInterrupt), naming it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def signal_name(exc: BaseException) -> str:
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


# A launcher forwards to its jobs the signal its process group got from the terminal (submitit's local controller,
# torchrun's agent), so a Ctrl-C reaches a job twice, milliseconds apart: the same signal again this soon after the
# first is that copy, not the user's second Ctrl-C (which would exit at once, without the stop's checkpoint).
FORWARDED_WITHIN_S = 0.5


@dataclass
class SignalState:
    """What this process's signal handlers have seen and set: the one place they keep it."""

    raised: list[int] = field(default_factory=list)  # stop signals raised as Signalled outside the loop (each ends
    # the command)
    last_stop: Optional[tuple[int, float]] = None  # the last stop signal that was not a launcher's copy, and when
    # the preemption signals whose handler the process's host set before ampctl's loop took them (submitit's job
    # environment sets SIGUSR2's to checkpoint and requeue its job): each is handed back to it after the stop
    hosts: dict[int, object] = field(default_factory=dict)
    leaving_with: Optional[int] = None  # the exit code of a command that stopped on a signal and is leaving

    def note_stop(self, signum: int) -> None:
        self.last_stop = (signum, time.monotonic())

    def a_forwarded_copy(self, signum: int) -> bool:
        return self.last_stop is not None and self.last_stop[0] == signum and \
            time.monotonic() - self.last_stop[1] < FORWARDED_WITHIN_S

    def reset(self) -> None:
        """As a fresh process has it (the tests' in-process commands: the process goes on after a command)."""
        if self.leaving_with is not None:
            atexit.unregister(_leave_now)
        self.raised, self.last_stop, self.hosts, self.leaving_with = [], None, {}, None


SIGNALS = SignalState()


def _raise_signalled(signum: int, _frame: Optional[FrameType]) -> None:
    if SIGNALS.a_forwarded_copy(signum):
        return
    SIGNALS.note_stop(signum)
    SIGNALS.raised.append(signum)
    raise Signalled(signum)


def _quiet_about_a_swallowed_signal(previous: Callable[[sys.UnraisableHookArgs], object]
                                    ) -> Callable[[sys.UnraisableHookArgs], None]:
    """A handler runs wherever the interpreter is when the signal lands, also inside a callback that cannot raise
    (importlib's module-lock clean-up, a weakref's callback, a __del__): Python prints the Signalled there as
    "Exception ignored in" with its traceback and goes on. It is recorded (SIGNALS.raised) and ends the command as any
    other does (raise_swallowed_signal; after a second Ctrl-C the command is ending already): its line is all that
    is said. Anything else goes to the hook that was there."""
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, Signalled):
            previous(unraisable)

    hook.quiet_about_signals = True  # type: ignore[attr-defined]
    return hook


def raise_on_signals() -> None:
    """Every stop or preemption signal raises Signalled (a KeyboardInterrupt, as Ctrl-C's): a command killed
    before (or after) its loop says so in one line instead of vanishing. Main thread only. A stop signal blocked by
    whoever started the process is unblocked (keep_ctrl_c_from_the_launchers_processes hands its mask on)."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [*STOP_SIGNALS, *PREEMPT_SIGNALS])
        if not getattr(sys.unraisablehook, "quiet_about_signals", False):
            sys.unraisablehook = _quiet_about_a_swallowed_signal(sys.unraisablehook)
        for signum in (*STOP_SIGNALS, *PREEMPT_SIGNALS):
            # one ignored when ampctl started stays ignored: nohup's SIGHUP, a shell's SIGINT to a background job
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _raise_signalled)


def _package_of(handler: object) -> str:
    return (getattr(handler, "__module__", None) or "").split(".")[0]


def _a_hosts_handler(handler: object) -> bool:
    """A handler set by code outside ampctl (ampctl's own, from its entry point or a study, are not a host's)."""
    return callable(handler) and _package_of(handler) not in ("ampctl", "signal", "_signal")


def host_of(signum: int) -> Optional[str]:
    """The package whose handler had this preemption signal before ampctl's loop (submitit), or None."""
    handler = SIGNALS.hosts.get(signum)
    return None if handler is None else (_package_of(handler) or "the process's host")


def hand_over(signum: int) -> tuple[Optional[int], Optional[str]]:
    """Call the host's handler for a preemption signal the run stopped on, now that its checkpoint is written: the
    host requeues the job and ends the process (submitit: SystemExit). Returns the exit code it chose (None when it
    returned without ending the process, as submitit's does on a rank other than 0) and, when it refused, why
    (submitit raises UncompletedJobError once a job has timed out hydra.launcher.max_num_timeout times)."""
    handler = SIGNALS.hosts[signum]
    try:
        handler(signum, None)  # type: ignore[operator]
    except SystemExit as exc:
        code = exc.code
        return (code if isinstance(code, int) else 0 if code is None else 1), None
    except Exception as exc:  # noqa: BLE001 - the host's refusal is said, and the run exits as a stopped run does
        return None, f"{type(exc).__name__}: {str(exc).strip()}"
    return None, None


def interrupt_behind(exc: BaseException) -> Optional[KeyboardInterrupt]:
    """The stop signal an exception comes from, or None. A KeyboardInterrupt (or Signalled) that lands inside a
    library's clean-up can leave an object half-updated, and the clean-up then fails with an error of its own whose
    context is the interrupt (Ctrl-C while Hydra composed: OmegaConf's flag_override restoring the flags of a node
    still being built raised AttributeError). That error is the signal's: it ends the command as the signal does."""
    seen: set[int] = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ if link.__cause__ is not None else link.__context__
    return None


@contextlib.contextmanager
def interrupts_surfaced() -> Iterator[None]:
    """An error raised because a stop signal broke off what was running comes out as that signal's interrupt."""
    try:
        yield
    except Exception as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is None:
            raise
        raise interrupt.with_traceback(None) from None


def raise_swallowed_signal() -> None:
    """Raise again a stop signal whose exception never reached ampctl: the command would carry on as if it had
    not been stopped. A signal that lands while a C extension is initialised comes out of the import as an
    ImportError, which a library importing it optionally takes for a missing package (torch's FLOP counter
    importing triton). Blocking the signals meanwhile does not help: torch's threads would take them. Every
    Signalled that reaches ampctl ends the command, so one recorded in a command still running was swallowed."""
    if SIGNALS.raised:
        raise Signalled(SIGNALS.raised[-1])


def signal_raised() -> bool:
    return bool(SIGNALS.raised)


class StopOnSignal:
    """SIGINT, SIGTERM, SIGHUP and a batch system's preemption warning (train.cluster.preempt_signal, or one its host
    handles: SIGNALS.hosts): stop at the next step where the run can (after this step, or the next log step when ranks
    must agree), with a checkpoint. The other preemption signals are ignored while it holds."""

    def __init__(self, announce: str = "after this step", preempt_signal: Optional[str] = None,
                 request_file: Optional[Path] = None) -> None:
        """request_file: a file whose appearance is a stop as on the signal it names (a sweep's launcher writes
        one for jobs its Ctrl-C does not reach: conf/sweeps.STOP_REQUEST), looked for at most once a second."""
        self.request_file, self._next_look = request_file, 0.0
        self.chosen = [signal.Signals[preempt_signal]] if preempt_signal else []
        self.signals: list[int] = [*STOP_SIGNALS, *self.chosen]
        self.ignored: list[int] = [signum for signum in PREEMPT_SIGNALS if signum not in self.chosen]
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        self._announce = announce  # when the run will stop; "" for a process that should not print

    @property
    def requested(self) -> bool:
        if self.signum is None and self.request_file is not None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + 1.0
            self._requested_by_file()
        return self.signum is not None

    def _requested_by_file(self) -> None:
        try:
            name = self.request_file.read_text(encoding="utf-8").strip()  # type: ignore[union-attr]
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError:
            name = ""
        self.signum = signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGINT
        if self._announce:
            print(f"\nampctl: the sweep's launcher was interrupted ({signal.Signals(self.signum).name}): stopping "
                  f"{self._announce} and writing a checkpoint", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            exit_at_once(signum, frame)
            return  # a launcher's copy of the first
        SIGNALS.note_stop(signum)
        self.signum = signum
        if self._announce:
            print(f"\nampctl: {signal.Signals(signum).name}: stopping {self._announce} and writing a checkpoint "
                  "(again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopOnSignal":
        raise_swallowed_signal()  # a stop before the loop: it ends the run before its first step
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in PREEMPT_SIGNALS:
                handler = signal.getsignal(signum)
                if _a_hosts_handler(handler):
                    SIGNALS.hosts[signum] = handler
                    self.ignored = [each for each in self.ignored if each != signum]
                    self.signals += [] if signum in self.signals else [signum]
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
            for signum in self.ignored:
                self._previous[signum] = signal.signal(signum, signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            # a run that stopped on a signal goes on only to say so and leave: another signal ends it at once
            stopping = self.requested and signum in self.signals
            signal.signal(signum, exit_at_once if stopping else handler)  # type: ignore[arg-type]


def exit_at_once(signum: int, _frame: Optional[FrameType] = None) -> None:
    """A second stop signal: one line, then exit now without unwinding (every checkpoint on disk is whole: each is
    written to a temporary name and renamed). A launcher's copy of the first signal is not another
    (FORWARDED_WITHIN_S)."""
    if SIGNALS.a_forwarded_copy(signum):
        return
    os.write(2, f"\nampctl: {signal.Signals(signum).name} again: exiting at once (the checkpoints on disk are "
                f"whole)\n".encode())
    os._exit(signal_exit_code(signum))


def exit_at_once_on_another_signal(signum: int, code: Optional[int] = None) -> None:
    """After a stop signal (signum) was handled: another one while ampctl says so and leaves ends it at once, with
    its line, instead of interrupting the exit halfway; and the exit skips the interpreter's teardown (torch's takes
    seconds, after Python has put the default handlers back, where a second Ctrl-C killed it without a word), with
    `code` (signal_exit_code unless the command's ending chose another). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for each in (*STOP_SIGNALS, *PREEMPT_SIGNALS):
        signal.signal(each, exit_at_once)
    if SIGNALS.leaving_with is None:
        atexit.register(_leave_now)
    SIGNALS.leaving_with = signal_exit_code(signum) if code is None else code


def _leave_now() -> None:
    """The last exit handler of a command that stopped on a signal: its files flushed, it leaves at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(SIGNALS.leaving_with if SIGNALS.leaving_with is not None else 0)


def keep_ctrl_c_from_the_launchers_processes() -> Optional[set]:
    """A sweep whose launcher starts a process of its own for each job (submitit's local controller) and stops it on
    Ctrl-C: the controller turns the terminal's SIGINT into a KeyboardInterrupt, sends its job SIGINT again and
    SIGKILL a second later (submitit.local.Controller.kill_tasks), which killed a job still writing its stop
    checkpoint, and printed a traceback. SIGINT is blocked in this (the main) thread while the launcher starts them:
    a blocked signal is inherited across fork and exec, so the controller never receives it, and each ampctl job
    unblocks it (raise_on_signals) and stops on the terminal's Ctrl-C with its checkpoint; the controller then
    ends as its job does. This process still takes the Ctrl-C in its other threads (the sweep's progress watcher,
    started before), which the interpreter hands to this thread's handler. Returns the mask it replaced, for
    give_ctrl_c_back (None: not the main thread, nothing changed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


def give_ctrl_c_back(mask_before: Optional[set]) -> None:
    """The main thread's signal mask as it was before keep_ctrl_c_from_the_launchers_processes."""
    if mask_before is not None and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_SETMASK, mask_before)
