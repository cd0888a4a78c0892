"""How much of the machine other processes took while a run measured its speed: the CPU time of every core that
was busy (Linux's /proc/stat) less this process's own and its children's (DataLoader workers), over wall time, in
cores. A step time measured while other processes took a core of two is not the run's speed alone (seen: one sweep's
jobs at 504 and 166 samples/s on one machine), and a run says so where it shows its throughput.

The test does not depend on how well the run uses its threads (a step's own core share would: Python's serial parts
leave intra-op threads idle on a quiet machine too). Read on log steps only (a few file reads); where /proc/stat is
not there (macOS), nothing is measured and nothing is said.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Other processes taking more than this share of the machine's cores (on average over a window) make it busy: on an
# idle machine, a shell, a terminal multiplexer and the kernel take a few hundredths of one core.
BUSY_SHARE = 0.25
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class Sample:
    wall_s: float
    machine_busy_s: float  # every core's busy time, summed
    own_s: float  # this process's CPU time and its children's


def sample() -> Optional[Sample]:
    """Now, or None where the kernel does not say (no /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields]
    # user nice system idle iowait irq softirq steal (guest is counted in user): idle and iowait are not busy
    busy = sum(ticks[:3]) + sum(ticks[5:8])
    return Sample(time.monotonic(), busy * _TICK_S, _own_cpu_s())


def _own_cpu_s() -> float:
    times = os.times()
    own = times.user + times.system
    for pid in _children():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        own += (int(stat[11]) + int(stat[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat(5))
    return own


def _children() -> list[str]:
    pids: list[str] = []
    try:
        for task in Path("/proc/self/task").iterdir():
            pids += (task / "children").read_text().split()
    except OSError:
        pass
    return pids


def others_cores(start: Optional[Sample], end: Optional[Sample]) -> Optional[float]:
    """The cores other processes kept busy on average between two samples; None where either is unknown."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return None
    others = (end.machine_busy_s - start.machine_busy_s) - (end.own_s - start.own_s)
    return max(0.0, others / (end.wall_s - start.wall_s))


def cores() -> int:
    return os.cpu_count() or 1


def busy(others: Optional[float]) -> bool:
    return others is not None and others > BUSY_SHARE * cores()


def said(others: float) -> str:
    """`other processes used 1.9 of 2 cores`"""
    return f"other processes used {others:.1f} of {cores()} cores"
