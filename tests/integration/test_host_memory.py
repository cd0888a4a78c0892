"""train.hold_host_memory: glibc's malloc keeps what a step frees (engine/host_memory.py). The setting is the
process's, so each side runs in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampctl.engine import host_memory

pytestmark = pytest.mark.skipif(not host_memory.glibc(), reason="mallopt is glibc's")

# a step's pattern in small: eight blocks of 8 MiB written, then all freed, again and again; the minor page faults a
# round costs once the first rounds have passed
CHURN = """
import resource, sys, torch
from ampctl.engine import host_memory
if sys.argv[1] == "held":
    assert host_memory.hold_freed_memory()
def churn():
    blocks = [torch.ones(2**20 * 8 // 4) for _ in range(8)]
    del blocks
for _ in range(3):
    churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    churn()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""
# glibc's starting thresholds (128 KiB), held there: with its defaults the thresholds adapt to what the process freed
# before, so that whether this churn faults depends on the heap's history (0 to 12,000 faults a round here, by the
# interpreter's start alone); from these every block is mapped and unmapped, 16,392 faults a round, every time
GLIBCS_START = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def faults_a_round(side: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHURN, side], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, **GLIBCS_START})
    return float(out.stdout.split()[-1])


def test_held_malloc_serves_freed_blocks_again_without_page_faults():
    default, held = faults_a_round("default"), faults_a_round("held")
    assert default >= 8, default  # each block's pages faulted in again every round (2,048 a block; fewer if huge)
    assert held < min(5, default / 10), (held, default)  # the pages stay mapped: none touched anew


def test_a_cpu_run_records_whether_it_held_host_memory(tmp_path: Path):
    for hold in (True, False):
        run_dir = tmp_path / str(hold)
        subprocess.run([sys.executable, "-m", "ampctl", "train", "device=cpu", "recipe=mlp", "recipe.hidden=16",
                        "train.steps=2", "train.console=quiet", f"train.hold_host_memory={str(hold).lower()}",
                        f"hydra.run.dir={run_dir}"], check=True, capture_output=True, timeout=300)
        assert json.loads((run_dir / "summary.json").read_text())["host_memory_held"] is hold
