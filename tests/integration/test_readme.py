"""Every command of the README's two-minute tour, run as a user runs it: each line in a shell, in a fresh
directory, with the installed `ampctl` on PATH. Each must succeed and leave what the README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def tour_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## A two-minute tour"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    return [line.split("   #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_tour_is_short_and_fast_on_any_machine():
    commands = tour_commands()
    assert 5 <= len(commands) <= 10 and all(c.startswith("ampctl ") for c in commands)
    assert all("recipe=mlp" in c or c.split()[1] in ("list", "init") for c in commands)


@pytest.mark.slow
def test_every_tour_command_runs(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as on the machine CI runs on
    for command in tour_commands():
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    runs = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    assert len(runs) >= 4  # three trainings, the compared modes and my_exp
    assert list((tmp_path / "outputs").rglob("metrics.csv"))  # logger=csv
    assert (tmp_path / "my_exp.yaml").is_file() and list((tmp_path / "outputs" / "compare").rglob("comparison.csv"))
    assert list((tmp_path / "outputs" / "inspect").rglob("ranges.csv")) and list(
        (tmp_path / "outputs" / "memory").rglob("memory.png"))
