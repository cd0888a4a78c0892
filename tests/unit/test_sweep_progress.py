"""The progress a sweep's launcher process prints for jobs that run elsewhere (reports/sweep_progress.py): each job's
newest step read from its metrics.jsonl, what runs, what finished, what is still to start, and an ETA for jobs that
run at the same time, checked against the figures computed by hand."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from ampctl.reports.sweep_progress import JobsProgress, newest_step


def _job(sweep: Path, name: str, steps: int, held: list) -> Path:
    job = sweep / name
    job.mkdir(parents=True)
    (job / "identity.json").write_text(json.dumps({"config": {"train": {"steps": steps}}}))
    lock = open(job / ".ampctl.lock", "w")  # held as a running job holds it (another open file: flock conflicts)
    lock.write("4242")
    lock.flush()
    fcntl.flock(lock, fcntl.LOCK_EX)
    held.append(lock)
    return job


def _rows(job: Path, upto: int) -> None:
    with open(job / "metrics.jsonl", "a") as f:
        start = (newest_step(job / "metrics.jsonl") or 0) + 1
        for step in range(start, upto + 1):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")


def test_the_progress_line_counts_jobs_and_gives_the_eta_of_jobs_running_at_once(tmp_path):
    held: list = []
    now = [100.0]
    first, second = _job(tmp_path, "0_lr=0.1", 100, held), _job(tmp_path, "1_lr=0.2", 100, held)
    (tmp_path / ".submitit").mkdir()  # the launcher's own files: not a job
    finished = tmp_path / "2_lr=0.3"
    finished.mkdir()
    (finished / "identity.json").write_text("{}")
    (finished / "summary.json").write_text("{}")
    _rows(first, 10)
    _rows(second, 5)
    progress = JobsProgress(tmp_path, 4, started=0.0, echo=print, clock=lambda: now[0])
    assert progress.poll() == ("ampctl sweep: #0 step 10/100, #1 step 5/100 (2 running, 1 finished, 1 to start) | "
                               "elapsed 0:01:40 | eta -")
    assert progress.poll() is None  # nothing moved: no line
    now[0] = 110.0
    _rows(first, 20)
    _rows(second, 10)
    # one job still to start: how many run at once is the batch system's, so no ETA
    assert progress.poll().endswith("(2 running, 1 finished, 1 to start) | elapsed 0:01:50 | eta -")
    progress.total_jobs = 3
    now[0] = 120.0
    _rows(first, 30)
    _rows(second, 15)
    # rates seen: #0 20 steps in 20 s (70 left: 70 s), #1 10 steps in 20 s (85 left: 170 s); they run at once
    assert progress.poll() == ("ampctl sweep: #0 step 30/100, #1 step 15/100 (2 running, 1 finished) | "
                               "elapsed 0:02:00 | eta 0:02:50")
    for lock in held:
        lock.close()
    _rows(first, 31)
    assert progress.poll() is None  # no job holds its lock: none is running


def test_the_newest_step_is_that_of_the_newest_whole_row(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert newest_step(metrics) is None
    metrics.write_text("".join(json.dumps({"step": s, "pad": "x" * 300}) + "\n" for s in range(1, 100)))
    assert newest_step(metrics) == 99  # found in the file's tail, past a row the cut began inside
    with open(metrics, "a") as f:
        f.write('{"step": 100, "lo')  # being written
    assert newest_step(metrics) == 99
