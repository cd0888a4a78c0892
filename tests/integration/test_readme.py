"""Every command of the README's two-minute tour, run as a user runs it: each line in a shell, in a fresh
directory, with the installed `ampctl` on PATH. Each must succeed and leave what the README says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def section_commands(heading: str) -> list[str]:
    """The commands of the first bash block under a README heading, without their comments."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    return [line.split("   #")[0].strip() for line in block.splitlines() if line.strip()]


def tour_commands() -> list[str]:
    return section_commands("## A two-minute tour")


def run_in_a_shell(command: str, cwd: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU, as on the machine CI runs on
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


def test_the_tour_is_short_and_fast_on_any_machine():
    commands = tour_commands()
    assert 5 <= len(commands) <= 10 and all(c.startswith("ampctl ") for c in commands)
    assert all("recipe=mlp" in c or c.split()[1] in ("list", "init") for c in commands)


@pytest.mark.slow
def test_every_tour_command_runs(tmp_path):
    for command in tour_commands():
        run_in_a_shell(command, tmp_path)
    runs = [p.parent for p in (tmp_path / "outputs").rglob("summary.json")]
    assert len(runs) >= 4  # three trainings, the compared modes and my_exp
    assert list((tmp_path / "outputs").rglob("metrics.csv"))  # logger=csv
    assert list(tmp_path.glob("ema/exports/step_00000060-ema-bfloat16/model.safetensors"))  # ampctl export
    assert (tmp_path / "my_exp.yaml").is_file() and list((tmp_path / "outputs" / "compare").rglob("comparison.csv"))
    assert list((tmp_path / "outputs" / "inspect").rglob("ranges.csv")) and list(
        (tmp_path / "outputs" / "memory").rglob("memory.png"))


@pytest.mark.slow
def test_every_your_own_model_command_runs(tmp_path):
    """The section's commands as written, in a directory that holds the my_images/ folder one of them names."""
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / "my_images" / label).mkdir(parents=True)
        for i in range(20):
            Image.new("RGB", (72, 80), color=(i * 12, 40 if label == "cat" else 200, 90)).save(
                tmp_path / "my_images" / label / f"{i}.png")
    commands = section_commands("## Your own model")
    assert 3 <= len(commands) <= 6 and all(c.startswith("ampctl ") for c in commands)
    for command in commands:
        run_in_a_shell(command, tmp_path)
    recipes = sorted(json.loads(p.read_text())["recipe"] for p in (tmp_path / "outputs").rglob("summary.json"))
    assert len(recipes) == 3, recipes
    assert list((tmp_path / "outputs" / "inspect").rglob("ranges.csv"))
