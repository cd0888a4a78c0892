"""Every `ampctl` command line in docs/*.md holds up as written (the README's are run by test_readme.py).

Each line of a bash block, and each `$ ` line of a console block, is taken as a shell would take it (continuation
lines joined, its comment and what follows `>` or `&&` left out, `torchrun ... -m`, `exec` and `VAR=value` before it
let through). A Hydra command composes, in the directory its block's earlier lines left (`ampctl init`, a `--cfg
job` dump: run for real), into a config its command's schema accepts: a recipe that does not ship, a key that does
not exist, a value out of range fail here. One cheap on a CPU (a demonstration recipe; recipe=mlp's trainings) is
run as written, in-process, and what its console block shows after it is what it prints, figures aside."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Optional

import pytest

from ampctl.shell.command import command_named, registry
from tests.support.in_process import run_ampctl

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md"))
HYDRA_COMMANDS = {name for name, command in registry().items() if command.is_hydra_app}
DEMONSTRATIONS = ("exploding", "fragile", "loss_spike", "rounding_spike")


class DocCommand:
    """One command line of a page: its words from `ampctl` on, and the lines its console block shows after it."""

    def __init__(self, page: str, block: int, words: list[str], shown: list[str]) -> None:
        self.page, self.block, self.words, self.shown = page, block, words, shown

    @property
    def command(self) -> str:
        return self.words[1]

    def overrides(self) -> list[str]:
        return [w for w in self.words[2:] if not w.startswith("-") and "=" in w]

    def flag(self, *names: str) -> Optional[str]:
        for i, word in enumerate(self.words):
            if word in names and i + 1 < len(self.words):
                return self.words[i + 1]
        return None

    def runs_here(self) -> bool:
        """Cheap on two CPU cores, as written: a demonstration recipe, or a single training of the MLP."""
        overrides = self.overrides()
        if "-m" in self.words or any(o.startswith(("device=cuda", "distributed=")) for o in overrides):
            return False
        recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), None)
        return recipe in DEMONSTRATIONS or (recipe == "mlp" and self.command == "train")

    def __repr__(self) -> str:
        return f"{self.page}: {' '.join(self.words)}"


def shell_words(line: str) -> Optional[list[str]]:
    """The ampctl command of a shell line, from `ampctl` on, without what redirects or follows it; None if none."""
    line = re.sub(r"\s#\s.*$", "", line).split(" && ")[0].split(" > ")[0].split(" | ")[0]
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    if "ampctl" not in words or words[0] in ("eval", "python"):
        return None
    words = [os.path.expandvars(word) for word in words]  # $HOME, as the shell expands it
    start = words.index("ampctl")
    before = words[:start]
    if before and not (before[-1] == "-m" or all(re.match(r"^[A-Z_]+=", w) or w == "exec" for w in before)):
        return None
    return ["ampctl", *words[start + 1:]] if len(words) > start + 1 else None


def doc_commands() -> list[DocCommand]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block, (language, body) in enumerate(re.findall(r"```(bash|console)\n(.*?)```", text, flags=re.DOTALL)):
            lines = body.replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                if language == "console" and not line.startswith("$ "):
                    continue
                words = shell_words(line.removeprefix("$ "))
                if words is None:
                    continue
                shown = []
                if language == "console":
                    shown = [out for out in lines[i + 1:] if out.strip()]
                    shown = shown[:next((j for j, out in enumerate(shown) if out.startswith("$ ")), len(shown))]
                found.append(DocCommand(page.name, block, words, shown))
    return found


COMMANDS = doc_commands()


def test_the_docs_commands_are_found():
    assert len(COMMANDS) >= 80 and {c.command for c in COMMANDS} >= {"train", "compare", "diff", "export", "init"}
    assert sum(c.runs_here() for c in COMMANDS) >= 6


def blocks_before(command: DocCommand) -> list[DocCommand]:
    """The lines before it in its block, which may make what it needs (a config from `ampctl init`, a dump)."""
    block = [c for c in COMMANDS if (c.page, c.block) == (command.page, command.block)]
    return block[:block.index(command)]


def make_what_it_needs(command: DocCommand, where: Path) -> None:
    page = (REPO / "docs" / command.page).read_text(encoding="utf-8")
    for earlier in blocks_before(command):
        if earlier.command == "init":
            assert run_ampctl(*earlier.words[1:], cwd=where).returncode == 0
        elif "--cfg" in earlier.words:  # `ampctl train ... --cfg job > x.yaml`
            [target] = re.findall(re.escape(" ".join(earlier.words[1:3])) + r".*--cfg job > (\S+)", page) or [None]
            dumped = run_ampctl(*earlier.words[1:], cwd=where)
            assert dumped.returncode == 0 and target, dumped.stderr
            (where / target).write_text(dumped.stdout)


def schema_check(command: DocCommand, where: Path) -> None:
    """Composed as its command's Hydra app would compose it, then typed and checked by its schema."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ampctl.conf.composing import without_hydra_node
    from ampctl.conf.schema import validate
    from ampctl.shell.hydra_internals import composed
    from ampctl.shell.plans import typed

    overrides = []
    for override in OverridesParser.create().parse_overrides(command.overrides()):
        if override.is_sweep_override():  # a sweep's first job (an Optuna interval is the sweeper's to draw)
            values = list(override.sweep_string_iterator()) if not override.is_interval_sweep() else []
            if values:
                overrides.append(f"{override.get_key_element()}={values[0]}")
        else:
            overrides.append(override.input_line)
    config_dir = command.flag("-cd", "--config-dir")
    name = command.flag("-cn", "--config-name") or command.command
    with composed(name, overrides, where / config_dir if config_dir else None) as cfg:
        validate(typed(command.command, without_hydra_node(cfg)))


@pytest.mark.parametrize("command", COMMANDS, ids=[repr(c) for c in COMMANDS])
def test_every_command_in_the_docs_holds_up(command, tmp_path, monkeypatch):
    assert command.command in registry(), command
    monkeypatch.chdir(tmp_path)
    make_what_it_needs(command, tmp_path)
    config_dir = command.flag("-cd", "--config-dir")
    if any(re.match(r"ampctl \w+: error: ", line) for line in command.shown):
        pytest.skip("a refusal the page shows: test_docs_examples.py runs it and compares its line")
    if command.command in HYDRA_COMMANDS:
        if config_dir and not (tmp_path / config_dir).is_dir():  # the user's own (my_conf, an advise directory)
            pytest.skip(f"-cd {config_dir}: a directory of the reader's own")
        if command.runs_here():
            return check_the_run(command, tmp_path)
        schema_check(command, tmp_path)
    elif command.command == "export":  # a run's path (a placeholder here), then its export.* overrides
        from ampctl.commands.export import export_settings

        export_settings(command.overrides())
    else:  # init, list, report: their own argument parsers, run for real where they write only here
        assert command_named(command.command).main is not None


def check_the_run(command: DocCommand, where: Path) -> None:
    done = run_ampctl(*command.words[1:], cwd=where)
    said = (done.stdout + done.stderr).splitlines()
    stopped = any(line.startswith(f"ampctl {command.command}: stopped:") for line in command.shown)
    assert done.returncode == (1 if stopped else 0), (command, done.stderr[-2000:])
    for line in command.shown:
        if line.startswith("done: "):  # what follows the loss (speed, MFU, a busy machine) is the machine's
            line = line[:line.index(" | final loss")] + " | final loss ..."
        assert any(shown_as(line, actual) for actual in said), (line, said[-10:])


NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?"


def shown_as(shown: str, actual: str) -> bool:
    """The page's line is the printed one, its figures aside: every number may differ, `...` stands for anything."""
    def pattern(text: str) -> str:
        pieces = re.split(f"({NUMBER})", text)  # the numbers at the odd places
        return "".join(NUMBER if i % 2 else re.escape(piece) for i, piece in enumerate(pieces))

    return re.fullmatch(".*".join(pattern(part) for part in shown.split("...")), actual) is not None
