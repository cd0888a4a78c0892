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


def wait_for(condition, timeout: float = 240, seen=lambda: "") -> None:
    """seen: what the failure says when the time runs out (a process's output so far)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, seen()
        time.sleep(0.02)


def popen(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ampctl", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def signal_mask(process: subprocess.Popen, which: str) -> int:
    """One of /proc's signal masks of a process (Linux): SigCgt (handled), SigIgn (ignored), SigBlk (blocked); 0
    once it is gone."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except FileNotFoundError:
        return 0
    return int(next(line for line in status.splitlines() if line.startswith(f"{which}:")).split()[1], 16)


def handles(process: subprocess.Popen, signum: int) -> bool:
    """Whether the process has a handler of its own for signum. Python handles only SIGINT by itself, so a handled
    SIGHUP means ampctl's entry point has set its handlers."""
    return bool(signal_mask(process, "SigCgt") >> (signum - 1) & 1)


def neither_ignores_nor_blocks(process: subprocess.Popen, signum: int) -> None:
    """A signal the test sends must reach the process: one ignored or blocked at its start came from this process
    (a child inherits both), and the test would wait on a process that never saw it."""
    import signal

    for which in ("SigIgn", "SigBlk"):
        assert not signal_mask(process, which) >> (signum - 1) & 1, (
            f"{signal.Signals(signum).name} in the child's {which}; this process: handler "
            f"{signal.getsignal(signum)}, blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}")


def row_count(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0
