"""Sweeps through Hydra's launcher plugins that run each job in a process of its own, with their local stand-ins:
hydra/launcher=submitit_local (submitit's local executor, what hydra-submitit-launcher's SLURM launcher is built
on) and hydra/launcher=ray (a local Ray, which ray.init starts). The sweep runs as a user runs it, in a real
process group that a terminal's Ctrl-C reaches as a whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.in_process import run_ampctl

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

REPO = Path(__file__).resolve().parents[2]
# a step of ~0.05 s spent waiting on the data (tests/support/slow_data_recipe.py): long jobs that cost little CPU
SLOW = ["device=cpu", "recipe=mlp", "recipe._target_=tests.support.slow_data_recipe.SlowDataRecipe",
        "+recipe.data_delay_s=0.05", "recipe.hidden=32", "recipe.batch_size=16", "train.console=plain",
        "train.log_every=1", "telemetry.profile_cpu_memory=false"]


def rows(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def _sweep_until(tmp_path: Path, sweep: list[str], rows_done: int, jobs: int = 1
                 ) -> tuple[subprocess.Popen, list[Path]]:
    """The sweep started as a user starts it (a session of its own, as a terminal's foreground group), until each of
    its first `jobs` jobs recorded rows_done steps: the process and those jobs' directories."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *sweep], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240

    def started() -> list[Path]:
        return sorted(job for job in (tmp_path / "sw").glob("[0-9]_*") if len(rows(job)) >= rows_done)

    while len(started()) < jobs:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    return process, started()


@pytest.mark.slow
def test_ctrl_c_on_a_submitit_sweep_stops_every_job_with_a_checkpoint_and_writes_the_table(tmp_path):
    sweep = ["train", "-m", "hydra/launcher=submitit_local", *SLOW, "train.steps=400", "optimizer.lr=0.001,0.002",
             "hydra.sweep.dir=sw"]
    process, _ = _sweep_until(tmp_path, sweep, 5, jobs=2)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole foreground group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("ampctl train: sweep")]
    assert said == [said[-1]] and "interrupted (SIGINT) while its launcher waited for the jobs; continue it with: " \
        "ampctl train -m hydra/launcher=submitit_local" in said[0] and "resume=auto" in said[0], err[-3000:]
    assert "before anything was recorded" not in err
    # submitit's per-job controller never saw the Ctrl-C: it printed a KeyboardInterrupt traceback each, and sent its
    # job SIGKILL a second after (a job still writing its stop checkpoint lost it); the continue command said once
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    after_the_start = out.split("\n", 1)[1] + err  # the start's line says it once, for a stop it cannot report
    assert after_the_start.count("continue the sweep with") + after_the_start.count("continue it with") == 1, \
        after_the_start
    table = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    jobs = sorted((tmp_path / "sw").glob("[01]_*"))
    assert len(jobs) == 2 and "interrupted" in out
    for job in jobs:  # each stopped at a step with its checkpoint there
        last = rows(job)[-1]["step"]
        assert 5 <= last < 400 and (job / "checkpoints" / f"step_{last:08d}.pt").is_file(), (job, last)
    assert table

    # the line's command continues both jobs from their checkpoints to the end
    continued = run_ampctl(*said[0].split("continue it with: ampctl ")[1].split(), cwd=tmp_path,
                           env={"PYTHONPATH": str(REPO)})
    assert continued.returncode == 0, continued.stderr[-3000:]
    # submitit's local executor ran both jobs at once on this machine: their samples/s shared its cores
    assert "throughput not comparable between jobs: jobs #0, #1 ran at the same time on one host" in \
        " ".join(continued.stdout.split())
    for job in jobs:
        assert [r["step"] for r in rows(job)] == list(range(1, 401))


@pytest.mark.slow
def test_a_job_killed_under_the_launcher_ends_the_sweep_in_its_table_and_one_line(tmp_path):
    """A job killed from outside (the OOM killer, a node lost; `kill -9` here): submitit's launcher raises
    UncompletedJobError. The sweep table of what is on disk, one line naming the failure and the command that
    continues, exit 1; no traceback. The killed job continues from its newest checkpoint with that command."""
    sweep = ["train", "-m", "hydra/launcher=submitit_local", *SLOW, "train.console=quiet", "train.steps=60",
             "train.checkpoint.every=5", "hydra.sweep.dir=sw"]
    process, [job] = _sweep_until(tmp_path, sweep, 6)
    os.kill(int((job / ".ampctl.lock").read_text()), signal.SIGKILL)  # the job's process, by its lock
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1 and "Traceback" not in err, err[-3000:]
    said = err.strip().splitlines()[-1]
    assert said.startswith("ampctl train: sweep ended: its launcher failed: UncompletedJobError: ") and \
        "; continue it with: ampctl train -m hydra/launcher=submitit_local" in said, said
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text()) and "interrupted" in out
    continued = run_ampctl(*said.split("continue it with: ampctl ")[1].split(), cwd=tmp_path,
                           env={"PYTHONPATH": str(REPO)})
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert [r["step"] for r in rows(job)] == list(range(1, 61))


def _job_log(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in sorted((tmp_path / "sw" / ".submitit").glob("*/*_log.*")))


@pytest.mark.slow
def test_submitits_warning_checkpoints_then_submitit_requeues_the_job_which_continues_its_run(tmp_path):
    """SIGUSR2, submitit's warning before a time limit or a preemption (SLURM sends it, `--signal=USR2@...`): the
    job stops at the end of its step with a checkpoint, then hands the signal to submitit's own handler, which
    requeues it (ampctl used to ignore SIGUSR2, which switched submitit's requeue off). The requeued job runs its
    original overrides, without resume=auto, and continues its own run: every step recorded once, the sweep ends
    0 with the job finished."""
    sweep = ["train", "-m", "hydra/launcher=submitit_local", *SLOW, "train.console=quiet", "train.steps=300",
             "train.checkpoint.every=1000", "hydra.sweep.dir=sw"]
    process, [job] = _sweep_until(tmp_path, sweep, 10)
    os.kill(int((job / ".ampctl.lock").read_text()), signal.SIGUSR2)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-3000:]
    log = _job_log(tmp_path)
    stopped = [line for line in log.splitlines() if line.startswith("ampctl train: interrupted at step ")]
    assert len(stopped) == 1 and "by SIGUSR2 (submitit's warning); checkpoint " in stopped[0], log[-3000:]
    assert "submitit requeued the job: it continues this run from its newest checkpoint" in log
    assert "ampctl train: batch job submitit-local:" in log and " was requeued: it continues its run in " in log
    at = int(stopped[0].split("at step ")[1].split()[0])
    assert f"at step {at}" in (job / "train.log").read_text() and (job / "checkpoints" / f"step_{at:08d}.pt").is_file()
    assert [r["step"] for r in rows(job)] == list(range(1, 301))  # each step once, across the two attempts
    # the launcher's terminal shows the job's progress, read from its records (its own lines are in its log)
    assert [line for line in out.splitlines() if line.startswith("ampctl sweep: #0 step ") and "/300 (1 running)"
            in line], out
    assert f"resumed from {job / 'checkpoints' / f'step_{at:08d}.pt'} at step {at}" in (job / "train.log").read_text()
    assert json.loads((job / "summary.json").read_text())["steps"] == 300


@pytest.mark.slow
def test_a_job_submitit_will_not_requeue_again_says_so_and_the_sweep_continues_from_its_checkpoint(tmp_path):
    """Past hydra.launcher.max_num_timeout timeouts (0 here; hydra.launcher.timeout_min=1 makes every warning a
    timeout) submitit refuses the requeue: the job's stop checkpoint is written first, its log says why it was not
    requeued and what continues it, the launcher's failure is the sweep's one line (exit 1), and that command
    finishes the job from its checkpoint."""
    sweep = ["train", "-m", "hydra/launcher=submitit_local", *SLOW, "train.console=quiet", "train.steps=60",
             "train.checkpoint.every=1000", "hydra.launcher.timeout_min=1", "+hydra.launcher.max_num_timeout=0",
             "hydra.sweep.dir=sw"]
    process, [job] = _sweep_until(tmp_path, sweep, 10)
    os.kill(int((job / ".ampctl.lock").read_text()), signal.SIGUSR2)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 1 and "Traceback" not in err, err[-3000:]
    log = _job_log(tmp_path)
    assert "submitit did not requeue the job (UncompletedJobError: Job not requeued because: timed-out too many " \
        "times.); continue the sweep with: ampctl train -m hydra/launcher=submitit_local" in log, log[-3000:]
    at = rows(job)[-1]["step"]
    assert (job / "checkpoints" / f"step_{at:08d}.pt").is_file() and at < 60
    said = err.strip().splitlines()[-1]
    assert said.startswith("ampctl train: sweep ended: its launcher failed: UncompletedJobError: "), said
    continued = run_ampctl(*said.split("continue it with: ampctl ")[1].split(), cwd=tmp_path,
                           env={"PYTHONPATH": str(REPO)})
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert [r["step"] for r in rows(job)] == list(range(1, 61))


@pytest.mark.slow
def test_ctrl_c_on_a_ray_sweep_stops_its_workers_with_their_checkpoints_through_the_stop_request(tmp_path):
    """hydra/launcher=ray (a local Ray, as ray.init starts it): Ray's workers are not in the launcher's process
    group, so a terminal's Ctrl-C never reached them and the driver's shutdown killed them without their stop
    checkpoints. The launcher's process, its wait ended by the signal (sent to it alone here), asks every job to stop
    (conf/sweeps.STOP_REQUEST in the sweep's directory); each stops at the end of its step with a checkpoint, and the
    sweep table and its line follow, exit 130. Its command continues both jobs to their last step."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    sweep = ["train", "-m", "hydra/launcher=ray", *SLOW, "train.console=quiet", "train.steps=300",
             "optimizer.lr=0.001,0.002", "hydra.sweep.dir=sw"]
    process, _ = _sweep_until(tmp_path, sweep, 5, jobs=2)
    os.kill(process.pid, signal.SIGINT)  # the launcher's process only: nothing reaches Ray's workers but the request
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("ampctl train: sweep")]
    assert said and "interrupted (SIGINT) while its launcher waited for the jobs; continue it with: ampctl train -m " \
        "hydra/launcher=ray" in said[-1], err[-3000:]
    for job in sorted((tmp_path / "sw").glob("[01]_*")):
        last = rows(job)[-1]["step"]
        assert last < 300 and (job / "checkpoints" / f"step_{last:08d}.pt").is_file(), (job, last)
        assert "interrupted at step" in (job / "train.log").read_text()
    # in a process of its own: ray.init in this one would leave its cluster running for the rest of the suite
    command = said[-1].split("continue it with: ampctl ")[1].split()
    continued = subprocess.run([sys.executable, "-m", "ampctl", *command], cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240)
    assert continued.returncode == 0, continued.stderr[-3000:]
    for job in (tmp_path / "sw").glob("[01]_*"):
        assert [r["step"] for r in rows(job)] == list(range(1, 301))
    # the launcher's terminal shows each job's step (Ray folds the jobs' own identical lines)
    assert [line for line in continued.stdout.splitlines() if line.startswith("ampctl sweep: #0 step ")], \
        continued.stdout[-3000:]
    assert not (tmp_path / "sw" / ".ampctl-stop").exists()  # the continued sweep's jobs did not stop on it


@pytest.mark.slow
def test_a_job_its_engine_runs_again_continues_its_earlier_attempt_instead_of_training_over_it(tmp_path):
    """Ray retries a task whose worker died (here: `kill -9` of the job's process) with its original overrides, in
    the job's directory: the job trained again from step 0 over its earlier attempt's records (every step twice in
    metrics.jsonl). It continues from its newest checkpoint: each step once, the sweep ends 0."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    sweep = ["train", "-m", "hydra/launcher=ray", *SLOW, "train.console=quiet", "train.steps=200",
             "train.checkpoint.every=20", "hydra.sweep.dir=sw"]
    process, [job] = _sweep_until(tmp_path, sweep, 45)
    os.kill(int((job / ".ampctl.lock").read_text()), signal.SIGKILL)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-3000:]
    assert "ampctl train: job #0 started again (its engine retried it): it continues its earlier attempt" in out + err
    assert [r["step"] for r in rows(job)] == list(range(1, 201))
    assert "resumed from " in (job / "train.log").read_text()
