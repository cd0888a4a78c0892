"""The runs of a comparison as processes that take turns (compare.rounds).

Every run is its own `ampctl train` process, forked from a server that has imported torch and ampctl already
(preloaded.py): no run inherits another's allocator caches, compiled kernels or peak-memory high-water
mark. They start one after another, each runs its warm-up and waits; then, round after
round, each runs its window of steps while the others wait (runner/round_windows.py is the other side), in an
order that rotates from round to round. Exactly one computes at any time, so load from elsewhere falls on all of
them alike. With one round nobody waits: each run trains whole, one after the other.

Ctrl-C (or SIGTERM) reaches every run once, forwarded from here, and the waiting ones are let go: each finishes
its step and writes a checkpoint (waited for, never killed); a second Ctrl-C ends them at once, as `ampctl train`
alone would. A run that is being started when the signal comes gets it as soon as it exists (it was not yet among
the runs to forward to). A deadline, where one is given, stops them the same way (SIGTERM) once it has passed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ampctl import run_files
from ampctl.interrupt import PREEMPT_SIGNALS, STOP_SIGNALS, exit_at_once_on_another_signal
from ampctl.preloaded import PreloadedProcess
from ampctl.processes import child_environment
from ampctl.runner.round_windows import ROUND_ENDS_ENV, ROUND_FD_ENV


def child_log(run_dir: Path) -> Path:
    """A mode's process output, beside its run directory (`<mode>.log`): the run directory is the run's own."""
    return run_dir.with_name(run_dir.name + ".log")


POLL_S = 0.5  # how often progress is read from the runs' metrics.jsonl while waiting


@dataclass
class RoundRun:
    label: str  # the comparison's row: "bf16", "bf16+compile"
    command: list[str]
    run_dir: Path
    steps: int
    error: Optional[str] = None
    stopped_by: Optional[int] = None  # the signal it was stopped by (SIGTERM for a deadline)
    out_of_time: bool = False  # stopped because the deadline passed, not by a signal from outside
    started_at: float = 0.0
    finished: bool = False

    def steps_done(self) -> int:
        metrics = self.run_dir / run_files.METRICS
        return metrics.read_bytes().count(b"\n") if metrics.is_file() else 0


class RoundProcess:
    """One run's process: started with its pause steps, told to go, waited for until it pauses or ends."""

    def __init__(self, run: RoundRun, round_ends: list[int]) -> None:
        self.run = run
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self._read_fd, write_fd = os.pipe()
        stdin_read, stdin_write = os.pipe()
        env = child_environment()  # dies with this process, even on kill -9 (ampctl/processes.py)
        if round_ends:
            env[ROUND_ENDS_ENV] = ",".join(map(str, round_ends))
        self._log = child_log(run.run_dir).open("w")
        run.started_at = time.perf_counter()
        # forked from the preloaded server, in a session of its own: a Ctrl-C at the terminal reaches it once,
        # forwarded from here
        try:
            self.process = PreloadedProcess(run.command, env=env, stdin=stdin_read, stdout=self._log.fileno(),
                                            stderr=self._log.fileno(),
                                            fds_in_env={ROUND_FD_ENV: write_fd} if round_ends else {})
        finally:
            os.close(write_fd)
            os.close(stdin_read)
        self.stdin = os.fdopen(stdin_write, "wb")
        self.let_go_after_writing = False
        self._buffer = b""
        self.sent = 0  # how many of the stop signals received so far it was sent

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, tick: Callable[[], None]) -> Optional[int]:
        """Until the run pauses (the step it paused after) or ends (None)."""
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], POLL_S)
            tick()
            if ready:
                data = os.read(self._read_fd, 256)
                self._buffer += data
                if b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    return int(line.split()[1])
                if data:
                    continue
            elif self.alive:
                continue
            # the pipe closed or the process ended (a process it forked may hold the pipe open after it)
            self.process.wait()
            return None

    def go(self) -> None:
        try:
            self.stdin.write(b"go\n")
            self.stdin.flush()
        except (BrokenPipeError, ValueError):  # it ended, or was let go already
            pass
        if self.let_go_after_writing:  # a stop signal's handler asked for it while this wrote
            self.let_go()

    def let_go(self) -> None:
        """No more waiting: it runs on to its end (or to the stop it was asked for)."""
        try:
            self.stdin.close()
        except BrokenPipeError:
            pass
        except RuntimeError:  # called by a stop signal's handler while go() was writing to the same pipe (a
            self.let_go_after_writing = True  # reentrant call on its buffer, CI): go() lets it go once it is done

    def catch_up(self, received: list[int]) -> None:
        """Send it each stop signal received that it was not sent yet (Ctrl-C as itself; any other stop as
        SIGTERM, which every run stops on, whatever its preempt_signal), and let it go."""
        for signum in received[self.sent:]:
            self.sent += 1
            if self.alive:
                self.process.send_signal(signum if signum == signal.SIGINT else signal.SIGTERM)
        if received:
            self.let_go()

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        os.close(self._read_fd)
        with contextlib.suppress(BrokenPipeError):
            self.stdin.close()
        self._log.close()


def run_in_rounds(runs: list[RoundRun], round_ends: list[int], on_progress: Callable[[int], None],
                 on_round: Callable[[int], None], on_finished: Callable[[RoundRun], None],
                 deadline: Optional[float] = None) -> list[RoundRun]:
    """Start every run, let them take turns through len(round_ends) rounds, wait for their ends. Returns the runs
    started: all of them, unless a signal or the deadline (time.monotonic()) stopped the comparison (each run's
    stopped_by and out_of_time say so). on_progress(steps done by all runs), on_round(r) after round r (1-based),
    on_finished(run) as each ends."""
    rounds = Rounds(round_ends, on_progress, on_round, on_finished, deadline)
    previous = {signum: signal.signal(signum, rounds.forward) for signum in Rounds.STOPS}
    try:
        rounds.start(runs)
        rounds.take_rounds()
        rounds.wait_for_the_ends()
    except BaseException:
        for process in rounds.processes:
            process.kill()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if rounds.received and not rounds.out_of_time:
            exit_at_once_on_another_signal(rounds.received[0])  # stopping: another signal while it is written
        for process in rounds.processes:
            process.close()
    return [p.run for p in rounds.processes]


class Rounds:
    """The runs of one comparison taking turns (run_in_rounds): the processes started, the stop signals received
    (each forwarded to every run), and whether the deadline passed."""

    STOPS = (*STOP_SIGNALS, *PREEMPT_SIGNALS)

    def __init__(self, round_ends: list[int], on_progress: Callable[[int], None], on_round: Callable[[int], None],
                 on_finished: Callable[[RoundRun], None], deadline: Optional[float]) -> None:
        self.round_ends, self.deadline = round_ends, deadline
        self.on_progress, self.on_round, self.on_finished = on_progress, on_round, on_finished
        self.processes: list[RoundProcess] = []
        self.received: list[int] = []
        self.out_of_time = False

    def forward(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        for process in self.processes:
            process.catch_up(self.received)

    @contextlib.contextmanager
    def signals_held(self) -> Iterator[None]:
        """The stop signals wait (in this thread) until the block ends: a run is not sent one twice."""
        signal.pthread_sigmask(signal.SIG_BLOCK, self.STOPS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.STOPS)

    def tick(self) -> None:
        self.on_progress(sum(p.run.steps_done() for p in self.processes))
        if self.deadline is not None and not self.received and time.monotonic() > self.deadline:
            self.out_of_time = True
            with self.signals_held():
                self.forward(signal.SIGTERM, None)

    def turn(self, process: RoundProcess) -> bool:
        """Until it pauses (False) or ends (True)."""
        return process.wait(self.tick) is None

    def finish(self, process: RoundProcess) -> None:
        _finish(process, self.received, self.on_finished, self.out_of_time)

    def start(self, runs: list[RoundRun]) -> None:
        """Each runs its warm-up (or, with one round, everything), then waits."""
        for run in runs:
            if self.received:
                break
            self.processes.append(RoundProcess(run, self.round_ends))
            with self.signals_held():  # those that came while it was being started, which forward() could not reach
                self.processes[-1].catch_up(self.received)
            if self.turn(self.processes[-1]):
                self.finish(self.processes[-1])

    def take_rounds(self) -> None:
        """Each round starts one run further (the order rotates): no mode always runs right after the same one."""
        processes = self.processes
        for r in range(len(self.round_ends)):
            order = processes[r % len(processes):] + processes[:r % len(processes)] if processes else []
            ended = []
            for process in order:
                if process.alive and not self.received:
                    process.go()
                    if self.turn(process):
                        ended.append(process)
            if not self.received:
                self.on_round(r + 1)
            for process in ended:  # said after the round they ended in
                self.finish(process)

    def wait_for_the_ends(self) -> None:
        for process in self.processes:  # ended already, or let go after a signal
            while process.wait(self.tick) is not None:  # a run let go may still say it pauses, then goes on
                pass
            self.finish(process)


def _finish(process: RoundProcess, received: list[int], on_finished: Callable[[RoundRun], None],
            out_of_time: bool) -> None:
    run = process.run
    if run.finished:
        return
    run.finished = True
    run.stopped_by = received[0] if received else None
    run.out_of_time = out_of_time
    if process.process.returncode != 0:
        run.error = child_error(child_log(run.run_dir), process.process.returncode)
    on_finished(run)


def child_error(log_path: Path, returncode: int) -> str:
    """The child's own error line ("ampctl train: error: ..." or a traceback's last line), not Hydra's."""
    lines = [line.strip() for line in log_path.read_text().splitlines() if line.strip()]
    own = [line.removeprefix("ampctl train: ") for line in lines if line.startswith("ampctl train: ")]
    line = own[-1] if own else lines[-1] if lines else f"exit code {returncode}"
    return f"{line} (see {log_path})"
