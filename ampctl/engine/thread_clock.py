"""How long the calling thread was blocked over a stretch of its time (waiting on a queue, a sleep, I/O), as distinct
from running and from waiting for a CPU that other processes held (a busy machine).

blocked = wall time - the thread's CPU time - its time runnable but not run. Linux keeps the last per thread in its
scheduler statistics (/proc/self/task/<tid>/schedstat's run delay, complete for every wait the thread has come back
from, so read exactly while it runs: a pread, under a microsecond). Where the kernel does not keep them, a stretch
counts as blocked only where the thread gave up the CPU itself (a voluntary context switch), all of its wall time
less its CPU time then: a busy machine that also made the thread wait for the GIL counts there, which is why the
run delay is preferred.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Optional

_LINUX = sys.platform.startswith("linux")


@dataclass(frozen=True)
class Mark:
    wall: float
    cpu: float
    run_delay_ns: Optional[int]  # Linux's scheduler statistics; None where there are none
    voluntary_switches: Optional[int]


class ThreadClock:
    """Marks and measures stretches of one thread's time; the thread that marks is the thread measured."""

    def __init__(self) -> None:
        self._tid: Optional[int] = None
        self._schedstat: Optional[IO[bytes]] = None

    def mark(self) -> Mark:
        # the run delay read first, the wall clock last, here, and the other way round at the end: a preemption
        # between the reads then counts in the run delay and not in the wall time, never as blocked
        run_delay_ns = self._run_delay_ns()
        switches = _voluntary_switches() if run_delay_ns is None else None  # only where there is no run delay
        return Mark(time.perf_counter(), time.thread_time(), run_delay_ns, switches)

    def since(self, start: Mark) -> tuple[float, float]:
        """(wall seconds, blocked seconds) since `start`."""
        wall_now, cpu_now = time.perf_counter(), time.thread_time()
        wall, cpu = wall_now - start.wall, cpu_now - start.cpu
        if start.run_delay_ns is not None:
            run_delay_ns = self._run_delay_ns()
            if run_delay_ns is not None:
                return wall, max(0.0, wall - cpu - (run_delay_ns - start.run_delay_ns) / 1e9)
        switches = _voluntary_switches()
        if start.voluntary_switches is None or switches != start.voluntary_switches:
            return wall, max(0.0, wall - cpu)
        return wall, 0.0

    def _run_delay_ns(self) -> Optional[int]:
        if not _LINUX:
            return None
        tid = threading.get_native_id()
        if tid != self._tid:  # the first mark, or another thread's
            self._tid, self._schedstat = tid, _open_schedstat(tid)
        if self._schedstat is None:
            return None
        fields = os.pread(self._schedstat.fileno(), 64, 0).split()  # on-CPU ns, run delay ns, timeslices
        return int(fields[1]) if len(fields) >= 2 else None


def _open_schedstat(tid: int) -> Optional[IO[bytes]]:
    try:
        return open(f"/proc/self/task/{tid}/schedstat", "rb", buffering=0)
    except OSError:  # a kernel without CONFIG_SCHED_INFO, or no /proc
        return None


def _voluntary_switches() -> Optional[int]:
    """The times this thread gave up the CPU itself (blocked or slept); None where the OS does not count them."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw if _LINUX else None
