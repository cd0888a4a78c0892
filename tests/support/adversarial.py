"""What the adversarial suite (tests/adversarial/) shares: ampctl as a user runs it, its one-line refusal,
waiting on a condition, a file's row count."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.in_process import run_ampctl
from tests.support.runs import REPO

MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
       "telemetry.profile_cpu_memory=false", "train.log_every=1"]


def cli(*args: str, cwd: Path, timeout: float = 300, real_process: bool = False) -> subprocess.CompletedProcess:
    """`ampctl *args` as a user runs it: its exit code, stdout and stderr. In this process (tests/support/
    in_process.py: what the command does, without a fresh interpreter's ~4 s of imports) unless real_process."""
    if not real_process:
        return run_ampctl(*args, cwd=cwd)
    return subprocess.run([sys.executable, "-m", "ampctl", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def one_line_refusal(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"ampctl {command}: error: "), result.stderr
    return result.stderr


def wait_for(condition, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def popen(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ampctl", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def handles(process: subprocess.Popen, signum: int) -> bool:
    """Whether the process has a handler of its own for signum (Linux: /proc's SigCgt mask). Python handles only
    SIGINT by itself, so a handled SIGHUP means ampctl's entry point has set its handlers."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def row_count(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0
