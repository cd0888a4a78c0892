"""The commands docs/sweeps.md and docs/runs.md give for machines this suite does not have (a SLURM cluster, a Ray
cluster, a bucket): each composes as written (every key exists, every value has its schema's type), with its
launcher's options where the launcher's plugin takes them (`--cfg hydra`, one job of the sweep: its first value of
each swept key).
What they do on such machines is tested with the local stand-ins (test_launchers.py, test_mirror.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.support.in_process import run_ampctl

REPO = Path(__file__).resolve().parents[2]


def commands(page: str, after_heading: str) -> list[list[str]]:
    """The `ampctl train` commands in the bash blocks of a page's section (to the next heading of its level or
    above)."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    level = re.search(rf"^(#+) {re.escape(after_heading)}$", text, flags=re.MULTILINE)
    assert level, after_heading
    section = text[level.end():]
    following = re.search(rf"^#{{1,{len(level.group(1))}}} ", section, flags=re.MULTILINE)
    section = section[:following.start()] if following else section
    found = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("ampctl train"):
                found.append(shlex.split(line)[2:])
    assert found, f"no ampctl train command under {after_heading!r} in {page}"
    return found


def one_job(args: list[str]) -> list[str]:
    """The command as one job of its sweep: -m dropped, each swept key at its first value."""
    return [arg.split("=", 1)[0] + "=" + arg.split("=", 1)[1].split(",")[0] if "=" in arg and "," in arg else arg
            for arg in args if arg != "-m"]


@pytest.mark.parametrize("page,heading,plugin", [
    ("sweeps.md", "On a SLURM cluster", "hydra_plugins.hydra_submitit_launcher"),
    ("sweeps.md", "On a Ray cluster", "hydra_plugins.hydra_ray_launcher"),
])
def test_the_cluster_commands_compose_with_their_launchers_options(tmp_path, page, heading, plugin):
    pytest.importorskip(plugin)
    for args in commands(page, heading):
        shown = run_ampctl("train", *one_job(args), "--cfg", "hydra", cwd=tmp_path)
        assert shown.returncode == 0, (args, shown.stderr)
        launcher = yaml.safe_load(shown.stdout)["hydra"]["launcher"]
        for arg in args:  # every launcher option the command sets is the launcher's, as set
            key, _, value = arg.lstrip("+").partition("=")
            if key.startswith("hydra.launcher."):
                node = launcher
                for part in key.split(".")[2:]:
                    node = node[part]
                assert str(node) == value, (key, node)


def test_the_mirror_command_composes(tmp_path):
    for args in _mirror_commands():
        shown = run_ampctl("train", *args, "--cfg", "job", cwd=tmp_path)
        assert shown.returncode == 0, (args, shown.stderr)
        assert yaml.safe_load(shown.stdout)["train"]["checkpoint"]["mirror"].startswith("s3://")


def _mirror_commands() -> list[list[str]]:
    """docs/runs.md's mirror commands (in a list item's bash block, indented)."""
    text = (REPO / "docs" / "runs.md").read_text(encoding="utf-8")
    found = [shlex.split(line.strip())[2:] for line in text.splitlines()
             if line.strip().startswith("ampctl train") and "train.checkpoint.mirror=" in line]
    assert found
    return found
