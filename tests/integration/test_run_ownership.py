"""A run directory belongs to one run (issue 13): a new run into a directory that holds a run is refused and
touches nothing; an empty hydra.run.dir is refused; resume=auto after a run killed before its first
checkpoint starts clean, the killed run's rows set aside. The runs that are killed, signalled or limited are real
processes (a real kill -9); the others run in this process (tests/support/in_process.py)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.in_process import run_ampctl
from tests.support.runs import QUICK, snapshot, start_a_long_run, steps

REPO = Path(__file__).resolve().parents[2]


def ampctl(*args: str, cwd: Path, real_process: bool = False) -> subprocess.CompletedProcess:
    """`ampctl train` with args; in this process (tests/support/in_process.py) unless real_process."""
    if not real_process:
        return run_ampctl("train", *QUICK, *args, cwd=cwd)
    return subprocess.run([sys.executable, "-m", "ampctl", "train", *QUICK, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def report(run_dir: Path) -> subprocess.CompletedProcess:
    return run_ampctl("report", str(run_dir))


def test_a_new_run_into_a_directory_that_holds_a_run_is_refused_and_touches_nothing(tmp_path):
    first = ampctl("train.steps=3", "hydra.run.dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = snapshot(tmp_path / "run")
    assert {"metrics.jsonl", "summary.json", ".hydra/config.yaml"} <= set(before)
    refused = "ampctl train: error: hydra.run.dir=run already holds a run (checkpoints/, identity.json, " \
              "metrics.jsonl, summary.json): continue it with resume=auto, or choose another hydra.run.dir\n"
    # `resume=` (empty) means "no resume": a new run, refused the same
    for new_run in (["train.steps=4", "train.seed=5"], ["train.steps=3", "resume="], ["train.steps=3", "resume=null"]):
        second = ampctl(*new_run, "hydra.run.dir=run", cwd=tmp_path)
        assert (second.returncode, second.stderr) == (2, refused), new_run
        assert snapshot(tmp_path / "run") == before  # its .hydra/config.yaml included
    # continuing it is what resume= is for
    resumed = ampctl("train.steps=4", "resume=auto", "hydra.run.dir=run", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert steps(tmp_path / "run" / "metrics.jsonl") == [1, 2, 3, 4]


def test_an_empty_run_dir_is_refused(tmp_path):
    result = ampctl("train.steps=1", "hydra.run.dir=", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ampctl train: error: hydra.run.dir='' is not allowed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs kill -9")
def test_resume_auto_after_a_run_killed_before_its_first_checkpoint_starts_clean(tmp_path):
    run_dir = tmp_path / "run"
    killed = start_a_long_run(run_dir, rows=3)
    metrics = run_dir / "metrics.jsonl"
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    old_rows = metrics.read_text()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())

    resumed = ampctl("train.steps=5", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert steps(metrics) == [1, 2, 3, 4, 5]  # not 1..N of the killed run followed by 1..5
    [set_aside] = run_dir.glob("metrics.jsonl.set-aside-*")
    assert set_aside.read_text() == old_rows  # kept, never deleted
    assert f"rows of a run that left no checkpoint set aside in {set_aside.name}" in resumed.stdout


def test_a_second_run_into_a_directory_in_use_is_refused_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    run_dir = tmp_path / "run"
    first = start_a_long_run(run_dir, rows=2)
    metrics = run_dir / "metrics.jsonl"
    before = (run_dir / ".hydra" / "config.yaml").read_bytes()
    # resume=auto would continue a finished run; into a running one it is refused, naming the holder
    second = ampctl("train.steps=3", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 2
    assert second.stderr == (f"ampctl train: error: hydra.run.dir={run_dir} is in use by another ampctl run "
                             f"(pid {first.pid}): wait for it to end, or choose another hydra.run.dir\n")
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == before
    # `ampctl report` on it says it is running, and writes nothing into a directory a run is writing
    running = report(run_dir)
    assert running.returncode == 0 and f"running (pid {first.pid}), at step" in running.stdout, running
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    interrupted = report(run_dir)
    # killed before its first checkpoint: it starts over, with its own config (its identity's)
    assert interrupted.returncode == 0 and f"interrupted at step {steps(metrics)[-1]}, before its first " \
        f"checkpoint; start it over with: ampctl train resume=auto hydra.run.dir={run_dir}" in \
        " ".join(interrupted.stdout.split()), interrupted
    assert not {"run.csv", "run.json", "report.md"} & {p.name for p in run_dir.iterdir()}
    # the kernel freed the lock with the process: the run continues at once (from its rows: no checkpoint yet)
    after_kill = ampctl("train.steps=3", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert after_kill.returncode == 0, after_kill.stderr
    assert steps(metrics) == [1, 2, 3]
    assert not (run_dir / ".ampctl.lock").exists()  # a run that ended leaves no lock file


def test_a_stopped_run_holds_its_directory_until_it_has_said_its_last_line(tmp_path):
    """A launcher waits for its stopping jobs' locks, then ends their workers (Ray's shutdown kills them): the
    lock was released before the job logged why it stopped, and a sweep's job ended without that line in its
    train.log. The command now holds its run's directory until its last line is written."""
    from ampctl.reports.runs import holder_pid

    run_dir = tmp_path / "run"
    held_at_each_line: list[tuple[str, object]] = []

    class LockAtEachLine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held_at_each_line.append((record.getMessage(), holder_pid(run_dir)))

    watcher = LockAtEachLine()
    logging.getLogger("ampctl.commands.train").addHandler(watcher)
    try:
        stopped = ampctl("train.steps=50", f"hydra.run.dir={run_dir}", "+recipe.signal_at=3",
                         "recipe._target_=tests.support.slow_data_recipe.SelfInterruptingRecipe", cwd=REPO)
    finally:
        logging.getLogger("ampctl.commands.train").removeHandler(watcher)
    assert stopped.returncode == 130, stopped.stderr
    [(line, holder)] = [(line, pid) for line, pid in held_at_each_line if line.startswith("ampctl train: interrupted")]
    assert holder == os.getpid(), (line, holder)
    assert line in (run_dir / "train.log").read_text()
    assert holder_pid(run_dir) is None and not (run_dir / ".ampctl.lock").exists()  # released as the command left


def test_a_full_disk_is_one_line_exit_74_and_the_earlier_checkpoints_stay_whole(tmp_path):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the next checkpoint's write fail as a full disk
    would (EFBIG instead of ENOSPC), without filling the machine's disk."""
    run_dir = tmp_path / "run"
    first = ampctl("train.steps=10", "train.checkpoint.every=5", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = snapshot(run_dir / "checkpoints")
    limit = (run_dir / "checkpoints" / "step_00000010.pt").stat().st_size // 2
    assert limit > 4 * (run_dir / "metrics.jsonl").stat().st_size  # the rows still fit: the checkpoint does not

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run([sys.executable, "-m", "ampctl", "train", *QUICK, "train.steps=20", "resume=auto",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          preexec_fn=small_files)
    assert full.returncode == 74, full.stderr
    assert full.stderr == (f"ampctl train: error: cannot write {run_dir}/checkpoints/step_00000015.pt.tmp: File too "
                           "large; the checkpoints written before it are whole (resume=auto continues from the "
                           "newest once it can write)\n")
    assert snapshot(run_dir / "checkpoints") == before  # no temporary file left, nothing earlier touched
    resumed = ampctl("train.steps=20", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert steps(run_dir / "metrics.jsonl") == list(range(1, 21))


def test_a_run_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    refused = ampctl("train.steps=1", "hydra.run.dir=/sys/ampctl-test-run", cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.startswith("ampctl train: error: cannot write /sys/ampctl-test-run: ")
    assert refused.stderr.endswith("; choose a writable hydra.run.dir (or hydra.sweep.dir)\n")


def test_a_ctrl_c_that_a_library_swallows_still_ends_the_run_before_its_first_step(tmp_path):
    """A Ctrl-C while a C extension is imported comes out as an ImportError, and a library importing it
    optionally goes on (torch's FLOP counter and triton): the run went on as if never stopped."""
    run_dir = tmp_path / "run"
    swallowed = ampctl(f"hydra.run.dir={run_dir}", "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
                       "+recipe.mistake=swallows_a_signal", cwd=REPO, real_process=True)
    assert swallowed.returncode == 130, swallowed.stderr
    assert swallowed.stderr.strip() == "ampctl train: interrupted (SIGINT) before the first step; nothing recorded"
    assert not run_dir.exists()


@pytest.mark.parametrize("after_hydra_s", [0.0, 1.0])  # as Hydra makes the run dir; while the model builds
def test_ctrl_c_before_the_first_step_exits_130_and_leaves_no_run_dir(tmp_path, after_hydra_s):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "ampctl", "train", *QUICK, f"hydra.run.dir={run_dir}",
                                "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
                                "+recipe.mistake=slow_build"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / ".hydra" / "config.yaml").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.0005)
    time.sleep(after_hydra_s)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "Traceback" not in stderr and stderr.strip().startswith("ampctl") and "interrupted (SIGINT) before" in stderr
    assert not run_dir.exists()
