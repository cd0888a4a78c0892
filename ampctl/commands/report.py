"""`ampctl report PATH`: the table, files and plots of a run, a multirun or a study's directory (each study command
whose COMMAND has a record and its rerender), again, from what the runs recorded (no re-training)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ampctl.errors import OneLineArgumentParser, SomeRunsFailed
from ampctl.shell.command import Command, Section, rerenderable
from ampctl.shell.outcomes import leave, said_in_one_line


def reportable() -> str:
    """What PATH may be: a run, a multirun, or the directory of a study whose command renders its record again."""
    studies = [command.name for command in rerenderable().values()]
    return f"a run, multirun, {', '.join(studies[:-1])} or {studies[-1]} directory"


def arguments() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="ampctl report", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"The table, files and plots of PATH again, from what its command recorded: nothing is\n"
                    f"trained again. PATH: {reportable()}.")
    parser.add_argument("path", metavar="PATH", type=Path, help="the directory ampctl wrote")
    return parser


def main() -> None:
    args = arguments().parse_args(sys.argv[1:])  # --help wherever it stands; a bad argument is one line, exit 2
    with said_in_one_line("report", " (the report's files were not written; what is on the screen is the report)"):
        from ampctl.studies.rerender import render  # torch, rich's tables: not for --help

        failed = render(args.path, {record: command.rerender for record, command in rerenderable().items()},
                        reportable())
    if failed:
        leave(SomeRunsFailed(failed), [])  # the table names them


COMMAND = Command(name="report", summary="the table, files and plots of any directory ampctl wrote, again",
                  section=Section.FILES, main=main, arguments=arguments)
