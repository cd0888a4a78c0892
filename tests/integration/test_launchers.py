"""Sweeps through Hydra's launcher plugins that run each job in a process of its own, with their local stand-ins:
hydra/launcher=submitit_local (submitit's local executor, what hydra-submitit-launcher's SLURM launcher is built
on). The sweep runs as a user runs it, in a real process group that a terminal's Ctrl-C reaches as a whole."""

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


@pytest.mark.slow
def test_ctrl_c_on_a_submitit_sweep_stops_every_job_with_a_checkpoint_and_writes_the_table(tmp_path):
    sweep = ["train", "-m", "hydra/launcher=submitit_local", *SLOW, "train.steps=400", "optimizer.lr=0.001,0.002",
             "hydra.sweep.dir=sw"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *sweep], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while not all(len(rows(job)) >= 5 for job in [*(tmp_path / "sw").glob("[01]_*")] or [tmp_path / "none"]):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole foreground group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("ampctl train: sweep")]
    assert said == [said[-1]] and "interrupted (SIGINT) while its launcher waited for the jobs; continue it with: " \
        "ampctl train -m hydra/launcher=submitit_local" in said[0] and "resume=auto" in said[0], err[-3000:]
    assert "before anything was recorded" not in err
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
             "train.checkpoint_every=5", "hydra.sweep.dir=sw"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *sweep], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while not [job for job in (tmp_path / "sw").glob("0_*") if len(rows(job)) >= 6]:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    [job] = (tmp_path / "sw").glob("0_*")
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
