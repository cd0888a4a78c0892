"""A killed sweep continues as docs/runs.md says: the same command plus resume=auto (the sweep stopped is a real
process; the commands after it run in this one). The sweep
names its directory and the command that continues it when it starts and when it is stopped; resume=auto without
hydra.sweep.dir finds the newest unfinished sweep of the same command; only the same sweep is continued in a
sweep directory; the sweep's own record is kept, and its table gains no `resume` column."""

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

REPO = Path(__file__).resolve().parents[2]
QUICK = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
         "telemetry.profile_cpu_memory=false"]
SWEEP = ["train", "-m", *QUICK, "train.steps=300", "train.checkpoint.every=25", "train.seed=1,2,3"]


def ampctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """In this process (tests/support/in_process.py); the processes a launcher starts see the test recipes."""
    return run_ampctl(*args, cwd=cwd, env={"PYTHONPATH": str(REPO)})


def steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()]


def stop_in_the_second_job(cwd: Path, *args: str) -> tuple[str, str]:
    """The sweep in a real process, SIGINT once its second job has checkpointed: returns what it printed."""
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *SWEEP, *args], cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 240
    while not list(cwd.glob("**/1_*/checkpoints/step_*.pt")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    return stdout, stderr


@pytest.mark.slow
def test_the_same_command_plus_resume_auto_continues_the_newest_unfinished_sweep(tmp_path):
    stdout, stderr = stop_in_the_second_job(tmp_path)
    [sweep] = tmp_path.glob("multirun/*/*")  # Hydra's default: multirun/<date>/<time>
    relative = sweep.relative_to(tmp_path)
    command = (f"ampctl train -m {' '.join(SWEEP[2:])} resume=auto hydra.sweep.dir={relative}")
    # named when it starts, and the continue line is the whole sweep's command, not one job's
    assert f"ampctl sweep: 3 jobs in {relative}; if it stops, continue it with: {command}" in stdout
    assert f"continue the sweep with: {command}" in stderr and "continue with: ampctl train resume=" not in stderr
    record = (sweep / "multirun.yaml").read_bytes()
    [finished] = sweep.glob("0_*")
    finished_rows = (finished / "metrics.jsonl").read_bytes()

    resumed = ampctl(*SWEEP, "resume=auto", cwd=tmp_path)  # the documented command, no hydra.sweep.dir
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume=auto continues the newest unfinished sweep of this command: {relative}" in resumed.stdout
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.glob("multirun/*/*")) == [relative]  # no new sweep
    assert f"job in {finished.resolve()} finished earlier (300 steps): kept as it is" in resumed.stdout
    assert (finished / "metrics.jsonl").read_bytes() == finished_rows
    assert "resumed from" in resumed.stdout
    for job in sorted(sweep.glob("[0-2]_*")):
        assert steps(job / "metrics.jsonl") == list(range(1, 301)), job.name
    assert (sweep / "multirun.yaml").read_bytes() == record  # the sweep's own record, not the resume's
    table = json.loads((sweep / "sweep.json").read_text())
    assert [row["status"] for row in table["rows"]] == ["ok"] * 3
    assert "resume" not in table["rows"][0] and "train.seed" in table["rows"][0]
    assert "resume" not in (sweep / "sweep.csv").read_text().splitlines()[0]


def test_resume_auto_without_an_unfinished_sweep_of_the_same_command_is_refused(tmp_path):
    done = ampctl("train", "-m", *QUICK, "train.steps=2", "train.seed=1,2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for other in (["train.seed=1,2"], ["train.seed=1,2,3"]):  # finished, and another command
        refused = ampctl("train", "-m", *QUICK, "train.steps=2", *other, "resume=auto", cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("ampctl train: error: resume=auto: no unfinished sweep of this command (")
        assert "under multirun/: give hydra.sweep.dir=<the sweep> to continue one" in refused.stderr
    assert len(list(tmp_path.glob("multirun/*/*"))) == 1


def test_another_sweep_is_not_taken_for_the_resume_of_a_finished_one(tmp_path):
    """Its jobs would sit beside the first sweep's as job 0 and 1 again, and merge into one table."""
    first = ampctl("train", "-m", *QUICK, "train.steps=2", "train.seed=0,1", "hydra.sweep.dir=sw", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.read_bytes() for p in (tmp_path / "sw").rglob("*") if p.is_file()}
    other = ampctl("train", "-m", *QUICK, "train.steps=2", "train.seed=2,3", "resume=auto", "hydra.sweep.dir=sw",
                   cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "hydra.sweep.dir=sw holds another sweep (" in other.stderr and "train.seed=0,1" in other.stderr
    assert "resume=auto continues only the same sweep" in other.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "sw").rglob("*") if p.is_file()} == before
    same = ampctl("train", "-m", *QUICK, "train.seed=0,1", "train.steps=2", "resume=auto", "hydra.sweep.dir=sw",
                  cwd=tmp_path)  # the same sweep, its overrides in another order: kept as it is
    assert same.returncode == 0 and same.stdout.count("finished earlier") == 2, same.stderr[-3000:]


def test_the_continue_command_keeps_how_the_sweep_was_launched(tmp_path):
    """A sweep on a launcher of Hydra's (hydra/launcher=submitit_slurm, its hydra.launcher.* settings) continues
    on it: the continue command keeps Hydra's own overrides, the sweep directory and mode apart."""
    launched = ["train", "-m", "hydra/launcher=basic", "hydra.job.chdir=false", *QUICK, "train.steps=2",
                "train.seed=1,2", "hydra.sweep.dir=sw"]
    first = ampctl(*launched, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    command = (f"ampctl train -m hydra/launcher=basic hydra.job.chdir=false {' '.join(QUICK)} train.steps=2 "
               "train.seed=1,2 resume=auto hydra.sweep.dir=sw")
    assert f"ampctl sweep: 2 jobs in sw; if it stops, continue it with: {command}" in first.stdout
    again = ampctl(*command.split()[1:], cwd=tmp_path)  # the command as printed
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished earlier (2 steps): kept as it is") == 2
