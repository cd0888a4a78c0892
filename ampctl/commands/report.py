"""`ampctl report PATH`: the table, files and plots of a run, a multirun or a study's directory (each study command
whose COMMAND has a record and its rerender), again, from what the runs recorded (no re-training)."""

from __future__ import annotations

import sys
from pathlib import Path

from ampctl.errors import SomeRunsFailed, UsageError
from ampctl.shell.command import Command, Section, rerenderable
from ampctl.shell.outcomes import leave, said_in_one_line


def reportable() -> str:
    """What PATH may be: a run, a multirun, or the directory of a study whose command renders its record again."""
    studies = [command.name for command in rerenderable().values()]
    return f"a run, multirun, {', '.join(studies[:-1])} or {studies[-1]} directory"


def usage() -> str:
    return (f"usage: ampctl report PATH   ({reportable()})\n\n"
            "The table, files and plots of PATH again, from what its command recorded: nothing is trained again.")


def complete(done: list[str], current: str) -> list[str]:
    """Shell completion: PATH, the shell's own file names."""
    return []


def main() -> None:
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:  # anywhere, as argparse takes it: `ampctl report PATH --help`
        print(usage())
        return
    with said_in_one_line("report", " (the report's files were not written; what is on the screen is the report)"):
        if len(args) != 1:
            raise UsageError(f"expected one PATH ({reportable()}), got {len(args)} arguments")
        from ampctl.studies.rerender import render  # torch, rich's tables: not for --help

        failed = render(Path(args[0]), {record: command.rerender for record, command in rerenderable().items()},
                        reportable())
    if failed:
        leave(SomeRunsFailed(failed), [])  # the table names them


COMMAND = Command(name="report", summary="the table, files and plots of any directory ampctl wrote, again",
                  section=Section.FILES, main=main, complete=complete)
