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


def ampctl_in(cwd: Path, *args: str, pythonpath: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampctl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": pythonpath})


def printed_command(stdout: str) -> list[str]:
    """The one command a study printed to run what it wrote, on a line of its own."""
    [line] = [line.strip() for line in stdout.splitlines() if line.strip().startswith("ampctl train -cd ")]
    return shlex.split(line)


def test_the_configs_ampctl_writes_for_a_users_recipe_run_as_printed_from_another_directory(tmp_path):
    """diff's repaired.yaml for an `ampctl init` experiment (its recipe module beside its configs, -cd), and a `--cfg
    job` dump of docs/models.md's example (its recipe found through PYTHONPATH=.), each run from another directory
    without either, as printed: a written config names where it was composed from in hydra.searchpath, and modules
    beside a config directory are importable."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    repo = str(Path(__file__).resolve().parents[2])
    initialised = ampctl_in(project, "init", "mine", pythonpath=repo)
    assert initialised.returncode == 0, initialised.stderr

    diffed = ampctl_in(project, "diff", "-cd", ".", "recipe=mine", "device=cpu", "precision=nvfp4", "diff.batches=2",
                       "diff.repair=true", "hydra.run.dir=diffed", pythonpath=repo)
    assert diffed.returncode == 0, diffed.stderr[-3000:]
    command = printed_command(diffed.stdout)
    assert command == ["ampctl", "train", "-cd", str(project / "diffed"), "-cn", "repaired"]
    trained = ampctl_in(elsewhere, *command[1:], "train.steps=3", "train.console=quiet", "hydra.run.dir=run",
                        pythonpath=repo)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((elsewhere / "run" / "summary.json").read_text())
    assert summary["recipe"] == "mine" and summary["precision"] == "nvfp4"

    section = readme_section("Add your own recipe")
    (project / "my_conf" / "recipe").mkdir(parents=True)
    (project / "my_recipes.py").write_text(code_blocks(section, "python")[0])
    (project / "my_conf" / "recipe" / "linreg.yaml").write_text(code_blocks(section, "yaml")[0])
    dumped = ampctl_in(project, "train", "-cd", "my_conf", "recipe=linreg", "precision=bf16", "--cfg", "job",
                       pythonpath=f"{repo}{os.pathsep}.")
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    (elsewhere / "dumped.yaml").write_text(dumped.stdout)
    rerun = ampctl_in(tmp_path, "train", "-cd", str(elsewhere), "-cn", "dumped", "train.steps=3", "train.console=quiet",
                      "hydra.run.dir=rerun", pythonpath=repo)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((tmp_path / "rerun" / "summary.json").read_text())["recipe"] == "linreg"
