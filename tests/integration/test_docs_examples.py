"""The refusals the README and docs show in their console blocks are what ampctl prints: each `$ ampctl ...`
followed by an `ampctl <command>: error: ...` line is run, and its one line compared. An example marked with a
comment (`# on a CPU with ...`) depends on the machine and is not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def refusal_examples() -> list[tuple[str, str, str]]:
    examples = []
    for page in PAGES:
        for block in re.findall(r"```console\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.DOTALL):
            lines = block.splitlines()
            for command, output in zip(lines, lines[1:]):
                if command.startswith("$ ampctl ") and "#" not in command and re.match(r"ampctl \w+: error: ", output):
                    examples.append((page.name, command[2:], output))
    return examples


EXAMPLES = refusal_examples()


def test_the_docs_show_refusals():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("page,command,said", EXAMPLES, ids=[f"{p}: {c}" for p, c, _ in EXAMPLES])
def test_a_refusal_the_docs_show_is_what_ampctl_prints(tmp_path, page, command, said):
    result = subprocess.run([sys.executable, "-m", *command.split()], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 2 and result.stderr.strip() == said, (page, result.stderr)
    assert list(tmp_path.iterdir()) == []
