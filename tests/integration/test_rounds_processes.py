"""compare's rounds (studies/rounds.py) with real child processes that speak runner/round_windows.py's protocol:
a stop signal reaches every run, one being started included, exactly once, and a deadline stops them as SIGTERM
does. The children are small scripts (a step is a sleep), so that the races are cheap to set up exactly."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ampctl.studies import rounds
from ampctl.studies.rounds import RoundRun, run_in_rounds

# A run that pauses where compare asks (AMPCTL_ROUND_ENDS, said on AMPCTL_ROUND_FD, waiting for a line on stdin;
# end of input: go on alone) and counts the stop signals it gets in signals.txt: the first stops it after its
# step; it never ends on its own within the test.
CHILD = r"""
import os, signal, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
(run_dir / "pid").write_text(str(os.getpid()))
received = []
def stop(signum, frame):
    received.append(signum)
    (run_dir / "signals.txt").write_text(" ".join(signal.Signals(s).name for s in received))
for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stop)
after = {int(s) for s in os.environ.get("AMPCTL_ROUND_ENDS", "").split(",") if s}
fd = int(os.environ.get("AMPCTL_ROUND_FD", "-1"))
step = 0
while not received:
    time.sleep(0.01)
    step += 1
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": %d}\n' % step)
    if step in after and not received:
        os.write(fd, b"paused %d\n" % step)
        if not sys.stdin.readline():
            after = set()
time.sleep(0.2)  # a second signal arriving now would be counted
"""


def runs(tmp_path: Path, n: int) -> list[RoundRun]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [RoundRun(f"mode{i}", [sys.executable, str(script), str(tmp_path / f"mode{i}")], tmp_path / f"mode{i}",
                    10**6) for i in range(n)]


def kill_the_children(runs: list[RoundRun]) -> None:
    """Each child by the pid it wrote (forked from the preloaded server, its command line is the server's)."""
    for run in runs:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((run.run_dir / "pid").read_text()), signal.SIGKILL)


def run_with_a_watchdog(started: list[RoundRun], *args, **kwargs) -> float:
    """run_in_rounds, its children killed after 60 s (a hang ends as a failure, not a stuck suite). Its seconds."""
    watchdog = threading.Timer(60, kill_the_children, (args[0],))
    watchdog.start()
    began = time.monotonic()
    try:
        started[:] = run_in_rounds(*args, **kwargs)
    finally:
        watchdog.cancel()
    return time.monotonic() - began


def test_a_stop_signal_that_comes_while_a_run_is_being_started_reaches_it_once(tmp_path, monkeypatch):
    """SIGTERM delivered inside the start of the second run, after its process exists but before it is among the runs
    to forward to (the window in which compare hung: the run warmed up, paused for its turn and waited forever)."""
    start = rounds.RoundProcess.__init__

    def start_then_signal(self, run, pause_after):
        start(self, run, pause_after)
        if run.label == "mode1":
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before run_in_rounds holds this process

    monkeypatch.setattr(rounds.RoundProcess, "__init__", start_then_signal)
    planned = runs(tmp_path, 3)
    started: list[RoundRun] = [planned[0]]
    seconds = run_with_a_watchdog(started, planned, [5, 10], lambda done: None, lambda r: None, lambda run: None)
    assert seconds < 30, "a run started as the signal came was never released"
    assert [run.label for run in started] == ["mode0", "mode1"]  # mode2 is not started after the signal
    for run in started:
        assert run.stopped_by == signal.SIGTERM and not run.out_of_time
    assert (started[0].run_dir / "signals.txt").read_text() == "SIGTERM"  # once, not twice (a second: at once)
    # mode1 got it at once: in its handler, or (before Python installed it) by SIGTERM's default action
    signals = started[1].run_dir / "signals.txt"
    assert signals.read_text() == "SIGTERM" if signals.is_file() else "exit code -15" in started[1].error
    assert not (tmp_path / "mode2").exists()


def test_a_deadline_stops_every_run_as_sigterm_does(tmp_path):
    planned = runs(tmp_path, 2)
    started: list[RoundRun] = [planned[0]]
    seconds = run_with_a_watchdog(started, planned, [5, 10**5], lambda done: None, lambda r: None,
                                  lambda run: None, deadline=time.monotonic() + 3)
    assert seconds < 30
    for run in started:
        assert run.stopped_by == signal.SIGTERM and run.out_of_time
        assert (run.run_dir / "signals.txt").read_text() == "SIGTERM"
    # mode0 was in its turn of round 1 (past its warm-up) when the deadline came, mode1 waiting for its own
    assert started[0].steps_done() > 5 and started[1].steps_done() == 5


def test_a_stop_signal_while_go_writes_lets_the_run_go_once_the_write_is_done():
    """Ctrl-C landing while go() flushed 'go' to a run's pipe: the handler's let_go closed the same buffered pipe,
    a reentrant call (RuntimeError, a traceback in CI). It now waits for the write and lets the run go after."""
    import io as stdio

    from ampctl.studies.rounds import RoundProcess

    class Pipe(stdio.BytesIO):
        def __init__(self, process):
            super().__init__()
            self.process, self.closed_after = process, None

        def flush(self):  # the signal lands here: its handler lets the run go
            self.process.let_go()

        def close(self):
            if not self.process.let_go_after_writing and self.closed_after is None and b"go" in self.getvalue():
                if self.process.handling:
                    raise RuntimeError("reentrant call inside <_io.BufferedWriter name=14>")
            self.closed_after = self.getvalue()
            super().close()

    process = RoundProcess.__new__(RoundProcess)
    process.let_go_after_writing, process.handling = False, True
    process.stdin = Pipe(process)
    process.go()
    assert process.stdin.closed and process.stdin.closed_after == b"go\n"  # written whole, then let go
