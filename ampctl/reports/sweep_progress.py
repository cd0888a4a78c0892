"""Progress of a sweep whose jobs run in processes of their own (hydra/launcher=submitit_slurm, submitit_local, ray):
the launcher's process only waits for them, and each job's progress goes to its own log file, so the terminal was
silent for the whole sweep. A thread of the launcher's process reads each job's newest row of metrics.jsonl every
PROGRESS_EVERY_S and prints one line when a job moved:

    ampctl sweep: #0 step 120/400, #1 step 80/400 (2 running) | elapsed 0:01:10 | eta 0:02:30

The ETA is that of jobs running at the same time (the slowest running job's steps left at the rate this thread
saw it go), not of jobs one after another; it is '-' while a job has not shown a rate yet or jobs are still to
start (how many a batch system runs at once is its own)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ampctl import io, run_files
from ampctl.reports.runs import holder_pid

PROGRESS_EVERY_S = 10.0
_TAIL_BYTES = 8192  # a metrics row is well under 1 KB: the newest whole one is in the file's last 8 KB


def newest_step(metrics: Path) -> Optional[int]:
    """The step of the newest whole row of a metrics.jsonl (a row being written is not whole yet), or None."""
    try:
        with open(metrics, "rb") as handle:
            handle.seek(0, 2)
            size = handle.seek(max(0, handle.tell() - _TAIL_BYTES))
            tail = handle.read()
    except OSError:
        return None
    lines = tail.split(b"\n")[:-1]  # after the last newline: a row not yet whole
    for line in reversed(lines[1:] if size else lines):  # the first of a cut tail may be a row's end
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _planned_steps(job: Path) -> Optional[int]:
    try:
        return int(json.loads((job / run_files.IDENTITY).read_text())["config"]["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _label(job: Path) -> str:
    number = job.name.split("_", 1)[0]  # Hydra's sweep subdir: <job number>_<overrides>
    return f"#{number}" if number.isdigit() else job.name


@dataclass
class _Seen:
    planned: Optional[int]
    first: tuple[int, float]  # (step, time) when this thread first saw the job step
    last: tuple[int, float]

    def rate(self) -> Optional[float]:
        steps, seconds = self.last[0] - self.first[0], self.last[1] - self.first[1]
        return steps / seconds if steps > 0 and seconds > 0 else None


class JobsProgress:
    """Watches the jobs of the sweep in sweep_dir (total_jobs of them, 0 when a sweeper decides) from a thread."""

    def __init__(self, sweep_dir: Path, total_jobs: int, started: float, echo: Callable[[str], None],
                 every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.sweep_dir, self.total_jobs, self.started = sweep_dir, total_jobs, started
        self.echo, self.every_s, self.clock = echo, every_s, clock
        self.seen: dict[Path, _Seen] = {}
        self._said: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="ampctl-sweep-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            line = self.poll()
            if line is not None and not self._stop.is_set():
                self.echo(line)

    def poll(self) -> Optional[str]:
        """The progress line, or None when no job moved since the last one."""
        now = self.clock()
        jobs = sorted((d for d in self._job_dirs()), key=lambda d: (len(_label(d)), _label(d)))
        parts, running, finished, etas = [], 0, 0, []
        for job in jobs:
            step = newest_step(job / run_files.METRICS)
            if (job / run_files.SUMMARY).is_file() or (job / run_files.ERROR).is_file():
                finished += 1
                continue
            if step is None or holder_pid(job) is None:
                continue
            running += 1
            seen = self.seen.get(job)
            if seen is None or step < seen.last[0]:  # new, or resumed from an earlier checkpoint
                seen = self.seen[job] = _Seen(_planned_steps(job), (step, now), (step, now))
            seen.last = (step, now)
            parts.append(f"{_label(job)} step {step}" + (f"/{seen.planned}" if seen.planned else ""))
            rate = seen.rate()
            etas.append((seen.planned - step) / rate if rate and seen.planned else None)
        if not parts:
            return None
        said = ", ".join(parts)
        if said == self._said:
            return None
        self._said = said
        waiting = self.total_jobs - finished - running if self.total_jobs else 0
        counts = [f"{running} running"] + ([f"{finished} finished"] if finished else []) + \
            ([f"{waiting} to start"] if waiting > 0 else [])
        eta = format_seconds(max(etas)) if etas and None not in etas and waiting <= 0 else "-"  # type: ignore[type-var]
        return (f"ampctl sweep: {said} ({', '.join(counts)}) | elapsed {format_seconds(now - self.started)} | "
                f"eta {eta}")

    def _job_dirs(self) -> list[Path]:
        try:
            return [d for d in self.sweep_dir.iterdir() if (d / run_files.IDENTITY).is_file()]
        except OSError:
            return []


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


# Hydra's own launcher runs each job in the launcher's process, where the job's progress is printed already
IN_PROCESS_LAUNCHERS = ("hydra._internal.core_plugins.basic_launcher.BasicLauncher",)


def watch(sweep_dir: Path, total_jobs: int, started: float) -> JobsProgress:
    """Start printing the progress of the sweep's jobs from this (the launcher's) process, until its stop();
    `started` is time.perf_counter()'s when the sweep started."""
    progress = JobsProgress(sweep_dir, total_jobs, started, lambda line: print(io.for_the_terminal(line), flush=True))
    progress.start()
    return progress
