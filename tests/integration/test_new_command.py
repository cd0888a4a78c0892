"""A command is declared once: a checkout of ampctl with three new files, the command's module (its COMMAND record),
its YAML and its study, has the command on the command line (routing, --help, one-line refusals, Hydra's own
--help and run directories, its log, `ampctl report` of its record) and in Python (ampctl.<name>()), with nothing
else edited. docs/architecture.md's
checklist names the same three files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

COMMAND_MODULE = '''
"""`ampctl greet [overrides]`: a test's command (a Hydra app over conf/greet.yaml: train's config plus greet.*)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from ampctl.conf.schema import AmpctlConfig, validate
from ampctl.conf.value_checks import require
from ampctl.shell.checks import one_device_only
from ampctl.shell.command import Command, Section, lazily
from ampctl.shell.python_api import study_api
from ampctl.shell.studies import Study, study_app

SUMMARY = "the recipe's parameter count, greeted"


@dataclass
class GreetConfig:
    greeting: str = "hello"
    times: int = 1

    def __post_init__(self) -> None:
        require(self.times >= 1, "greet.times", self.times, "an integer >= 1")


@dataclass
class GreetAppConfig(AmpctlConfig):
    greet: GreetConfig = field(default_factory=GreetConfig)


def check(cfg: DictConfig) -> None:
    validate(cfg)
    one_device_only(cfg, "greet")


def run(study: Study) -> Optional[int]:
    from ampctl.studies.greet import run_greet

    run_greet(study.cfg, study.out_dir)
    return None


COMMAND = Command(name="greet", summary=SUMMARY, section=Section.STUDY, schema=GreetAppConfig, check=check,
                  main=study_app("greet", run), api=study_api("greet", run, "greeting", SUMMARY),
                  record="greeting", rerender=lazily("ampctl.studies.greet:rerender"))
'''

COMMAND_YAML = """# Primary config of `ampctl greet`: everything of `ampctl train`, plus the greet node.
defaults:
  - ampctl_greet_schema
  - run_defaults
  - _self_

hydra:
  callbacks:
    check_every_job:
      _target_: ampctl.shell.checks.CheckEveryJob
      command: greet
  job:
    name: greet
  help:
    app_name: ampctl greet
    header: |
      ampctl greet: the recipe's parameter count, greeted.
  run:
    dir: outputs/greet/${now:%Y-%m-%d}/${now:%H-%M-%S}
"""

STUDY_MODULE = '''
"""The greet study: builds the recipe's model and writes its parameter count, greeted."""

import json
from pathlib import Path

from omegaconf import DictConfig

from ampctl.recipes.base import build_recipe


def run_greet(cfg: DictConfig, out_dir: Path) -> None:
    model = build_recipe(cfg.recipe).build_model()
    count = sum(p.numel() for p in model.parameters())
    line = " ".join([cfg.greet.greeting] * cfg.greet.times) + f", {count} parameters"
    (out_dir / "greeting.json").write_text(json.dumps({"line": line, "parameters": count}))
    print(line)


def rerender(out_dir: Path, console) -> int:
    """`ampctl report` of a greeting's directory: its line again, and greeting.md."""
    line = json.loads((out_dir / "greeting.json").read_text())["line"]
    (out_dir / "greeting.md").write_text(f"# greeting\\n\\n{line}\\n")
    console.print(line)
    return 0
'''


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """ampctl as a contributor's checkout has it, plus the new command's three files."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(REPO / "ampctl", root / "ampctl", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "ampctl" / "commands" / "greet.py").write_text(COMMAND_MODULE)
    (root / "ampctl" / "conf" / "greet.yaml").write_text(COMMAND_YAML)
    (root / "ampctl" / "studies" / "greet.py").write_text(STUDY_MODULE)
    return root


def ampctl(checkout: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # the checkout before the installed ampctl
    return subprocess.run([sys.executable, "-m", "ampctl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.slow
def test_a_command_is_its_module_its_yaml_and_its_study(checkout, tmp_path):
    listed = ampctl(checkout, tmp_path, "--help")
    assert listed.returncode == 0 and "  greet    the recipe's parameter count, greeted" in listed.stdout

    helped = ampctl(checkout, tmp_path, "greet", "--help")
    assert helped.returncode == 0 and "ampctl greet: the recipe's parameter count, greeted." in helped.stdout
    assert "greet.times" in helped.stdout or "greeting" in helped.stdout, helped.stdout[-2000:]

    ran = ampctl(checkout, tmp_path, "greet", "device=cpu", "recipe=mlp", "greet.times=2", "hydra.run.dir=out")
    assert ran.returncode == 0, ran.stderr[-2000:]
    record = json.loads((tmp_path / "out" / "greeting.json").read_text())
    assert record["line"].startswith("hello hello, ") and record["parameters"] > 0
    assert (tmp_path / "out" / ".hydra" / "config.yaml").is_file()  # Hydra's run directory, as every command's
    assert (tmp_path / "out" / "greet.log").is_file()  # and its log

    reported = ampctl(checkout, tmp_path, "report", "out")  # its record rendered again, from its COMMAND alone
    assert reported.returncode == 0 and record["line"] in reported.stdout, reported.stderr[-2000:]
    assert (tmp_path / "out" / "greeting.md").read_text() == f"# greeting\n\n{record['line']}\n"
    assert "greet" in ampctl(checkout, tmp_path, "report", "--help").stdout

    # what a start that recorded nothing leaves (Hydra's files, its log) does not hold the directory
    left = tmp_path / "left"
    shutil.copytree(tmp_path / "out" / ".hydra", left / ".hydra")
    shutil.copy(tmp_path / "out" / "greet.log", left / "greet.log")
    again = ampctl(checkout, tmp_path, "greet", "device=cpu", "recipe=mlp", "hydra.run.dir=left")
    assert again.returncode == 0 and (left / "greeting.json").is_file(), again.stderr[-2000:]

    refused = ampctl(checkout, tmp_path, "greet", "device=cpu", "greet.times=0", "hydra.run.dir=bad")
    assert (refused.returncode, refused.stderr) == (2, "ampctl greet: error: greet.times=0 is not allowed: expected "
                                                       "an integer >= 1\n")
    assert not (tmp_path / "bad").exists()
    taken = ampctl(checkout, tmp_path, "greet", "device=cpu", "hydra.run.dir=out")  # a directory with a record
    assert taken.returncode == 2 and taken.stderr.startswith("ampctl greet: error: ") and \
        taken.stderr.count("\n") == 1, taken.stderr

    from_python = subprocess.run(
        [sys.executable, "-c", "import ampctl, json; r = ampctl.greet(['device=cpu', 'recipe=mlp'], out_dir='py'); "
                               "print(json.dumps(r.summary)); print('greet' in dir(ampctl))"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True, text=True, timeout=240)
    assert from_python.returncode == 0, from_python.stderr[-2000:]
    assert json.loads(from_python.stdout.splitlines()[-2])["line"].startswith("hello, ")
    assert from_python.stdout.splitlines()[-1] == "True"
