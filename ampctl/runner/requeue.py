"""SLURM's automatic requeue (Lightning's `auto_requeue`): a run stopped by its preemption warning
(train.cluster.preempt_signal, which `sbatch --signal=USR1@120` sends) inside a SLURM job puts the job back in the
queue once its checkpoint is written, with `scontrol requeue`; the requeued job (same job id, same script,
SLURM_RESTART_COUNT > 0) continues the run (a_requeue_of). No hand-written trap in the batch script.

Under submitit (hydra/launcher=submitit_slurm, submitit_local) the engine requeues its own jobs: its warning is
handed to it once the checkpoint is written (interrupt.hand_over), and the requeued job, which runs its original
overrides again, continues its run without resume=auto: the run's identity.json names the batch job that started it
(batch_job), and a job whose id is that one, with the same config, is the same job requeued."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional


def slurm_job_id() -> Optional[str]:
    """This SLURM job's id as scontrol names it (an array task: `<array job>_<task>`), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def batch_job() -> Optional[str]:
    """The batch job this process runs in, as `<engine>:<job id>` (submitit's job environment under submitit, else
    SLURM's), or None outside one. A requeued job keeps its id (SLURM's; submitit's local executor's too)."""
    executor = os.environ.get("SUBMITIT_EXECUTOR")
    if executor:
        import submitit

        return f"submitit-{executor}:{submitit.JobEnvironment().job_id}"
    job = slurm_job_id()
    return None if job is None else f"slurm:{job}"


def a_requeue_of(job: Optional[str]) -> bool:
    """Whether this process is `job` (a run's recorded batch job) started again by its engine: submitit's job of that
    id (the launcher gives each job a run directory of its own, and a sweep into a used one is refused), or a SLURM
    job of that id that SLURM restarted (SLURM_RESTART_COUNT)."""
    here = batch_job()
    if job is None or here != job:
        return False
    return here.startswith("submitit-") or os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")


def requeue() -> Optional[str]:
    """Requeue this SLURM job; the line saying what happened, or None outside SLURM."""
    job = slurm_job_id()
    if job is None:
        return None
    command = shutil.which("scontrol") or "scontrol"
    try:
        done = subprocess.run([command, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not requeue SLURM job {job}: {exc}; requeue it by hand (scontrol requeue {job})"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"could not requeue SLURM job {job}: {reason[0]}; requeue it by hand (scontrol requeue {job})"
    return f"requeued SLURM job {job}: it continues this run when it starts again"
