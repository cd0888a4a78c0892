"""engine/thread_clock.py: a stretch of the thread's time is blocked where it slept or waited on a queue, not where
it computed, nor where a busy machine kept it off the CPU."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ampctl.engine import thread_clock
from ampctl.engine.thread_clock import ThreadClock


def spin(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


@pytest.fixture
def two_busy_loops():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait()


def test_a_sleep_is_blocked_and_the_threads_own_work_is_not():
    clock = ThreadClock()
    start = clock.mark()
    time.sleep(0.05)
    wall, blocked = clock.since(start)
    assert blocked >= 0.049 and blocked <= wall
    start = clock.mark()
    spin(0.03)
    wall, blocked = clock.since(start)
    assert wall >= 0.03 and wall - blocked >= 0.03  # its own 30 ms of CPU are never blocked time


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the run delay is Linux's")
def test_a_busy_machine_keeping_the_thread_off_the_cpu_is_not_blocked_time(two_busy_loops):
    """Beside two busy loops on CI's two cores the spinning thread waits for a CPU, often longer than it runs: the
    scheduler's run delay says so, and none of it is blocked."""
    clock = ThreadClock()
    blocked = []
    for _ in range(5):
        start = clock.mark()
        spin(0.03)
        blocked.append(clock.since(start)[1])
    assert max(blocked) < 0.002, blocked  # the reads' own microseconds at most


def test_without_scheduler_statistics_a_sleep_is_still_blocked(monkeypatch):
    monkeypatch.setattr(thread_clock, "_open_schedstat", lambda tid: None)  # a kernel without them
    clock = ThreadClock()
    start = clock.mark()
    assert start.run_delay_ns is None
    time.sleep(0.05)
    assert clock.since(start)[1] >= 0.049  # it gave up the CPU itself: a voluntary switch
