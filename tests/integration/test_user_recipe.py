"""docs/models.md's "Add your own recipe" example, run exactly as the page tells a user to run it."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def readme_section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"### {title}")
    ends = [i for i in (text.find("\n## ", start), text.find("\n### ", start + 1)) if i != -1]
    return text[start:min(ends, default=len(text))]


def code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def test_the_readme_recipe_example_trains(tmp_path):
    section = readme_section("Add your own recipe")
    [python_source] = code_blocks(section, "python")
    [yaml_source] = code_blocks(section, "yaml")
    [command] = code_blocks(section, "bash")
    (tmp_path / "my_recipes.py").write_text(python_source)
    (tmp_path / "my_conf" / "recipe").mkdir(parents=True)
    (tmp_path / "my_conf" / "recipe" / "linreg.yaml").write_text(yaml_source)

    words = shlex.split(command.strip())
    env_assignments = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    args = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    assert args[0] == "ampctl"
    result = subprocess.run(
        [sys.executable, "-m", "ampctl", *args[1:], "train.console=plain"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, **{k: str(tmp_path / v) if v == "." else v for k, v in env_assignments.items()}},
    )
    assert result.returncode == 0, result.stderr
    [run_dir] = list((tmp_path / "outputs").glob("*/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["recipe"] == "linreg" and summary["precision"] == "bf16" and len(rows) == 100
    assert summary["tail_loss"] < 0.2 * rows[0]["loss"]  # it really fits the regression
