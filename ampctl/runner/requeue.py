"""SLURM's automatic requeue (Lightning's `auto_requeue`): a run stopped by its preemption warning
(train.preempt_signal, which `sbatch --signal=USR1@120` sends) inside a SLURM job puts the job back in the
queue once its checkpoint is written, with `scontrol requeue`; the requeued job (same job id, same script)
continues the run with `resume=auto`. No hand-written trap in the batch script."""

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
    return f"requeued SLURM job {job}: it continues this run with resume=auto when it starts again"
