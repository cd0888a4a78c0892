"""Starting and reading runs from a test: a long run to signal or kill, torchrun jobs, a run directory's bytes
and rows, a bit flipped in a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
QUICK = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "train.console=quiet", "telemetry.profile_cpu_memory=false",
         "train.log_every=1"]


class ForkedAmpctl:
    """`python -m ampctl ARGS`, a real process of its own forked from ampctl's preloaded server
    (ampctl/preloaded.py; tests/integration/test_preloaded_processes.py checks that it is the process its
    command line would exec): for a test that needs a process (to kill it, to signal it in its loop) but not its
    start, which then takes ~1.5 s to the first step instead of a fresh interpreter's ~7 s. What Popen offers
    such a test: pid, poll, wait, send_signal, returncode, communicate. Tests of a process's start use Popen."""

    def __init__(self, *args: str, cwd: Path, env: Optional[dict[str, str]] = None) -> None:
        """env: the child's environment (default: this process's, with the repository on PYTHONPATH)."""
        from ampctl.preloaded import PreloadedProcess

        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._process = PreloadedProcess([sys.executable, "-m", "ampctl", *args], cwd=cwd,
                                         env=env if env is not None else {**os.environ, "PYTHONPATH": str(REPO)},
                                         stdout=self._out.fileno(), stderr=self._err.fileno())
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.returncode

    def poll(self) -> Optional[int]:
        return self._process.poll()

    def send_signal(self, signum: int) -> None:
        self._process.send_signal(signum)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._process.wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired("ampctl", timeout)
        return code

    def stderr_so_far(self) -> str:
        return self._read(self._err)

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        self.wait(timeout)
        return tuple(self._read(stream) for stream in (self._out, self._err))  # type: ignore[return-value]

    @staticmethod
    def _read(stream) -> str:
        stream.seek(0)
        return stream.read().decode(errors="replace")


def start_a_long_run(run_dir: Path, rows: int) -> ForkedAmpctl:
    """`ampctl train` for 100000 steps into run_dir, returned once it has written `rows` metrics rows."""
    process = ForkedAmpctl("train", *QUICK, "train.steps=100000", f"hydra.run.dir={run_dir}", cwd=run_dir.parent)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= rows):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before writing rows"
        time.sleep(0.01)
    return process


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def torchrun(run_dir: Path, *args: str, nproc: int = 2, torchrun_args: tuple[str, ...] = ()
             ) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
         "-m", "ampctl", "train", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=run_dir.parent, env=env,
    )


def torchrun_on_two_nodes(run_dirs: tuple[Path, Path], *args: str) -> list[subprocess.CompletedProcess]:
    """One job over two "nodes" on this machine: two torchrun agents (--nnodes=2, one process each) meeting at a
    c10d rendezvous on 127.0.0.1, as two hosts of a cluster would, each running the same command with the run
    directory its node sees (the same path on shared storage; two paths: disks local to each node)."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=ampctl-test-{port}", "-m", "ampctl", "train", *args,
         f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run_dir.parent, env=env) for run_dir in run_dirs]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    return [subprocess.CompletedProcess(agent.args, agent.returncode, out, err)
            for agent, (out, err) in zip(agents, outputs)]


COMPARED = ("step", "loss", "loss_scale", "skipped", "skipped_total", "grad_norm", "lr")


def rows(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # in the middle of the tensors' bytes: torch.load alone would not notice
    path.write_bytes(bytes(data))
